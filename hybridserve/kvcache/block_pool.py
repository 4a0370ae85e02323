"""BlockPool: every cache group's blocks, reference counts, the LRU free queue, the hash map.

Block 0 is the null block: the placeholder for skipped positions; never freed, hashed or counted.
A block is in the free queue iff its ref count is 0. A free block may still carry a hash (an
evictable cached block); handing it out again evicts it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from hybridserve.core.errors import CacheInvariantError

if TYPE_CHECKING:
    from hybridserve.kvcache.events import CacheEvents
    from hybridserve.kvcache.host_tier import HostTier


class Block:
    """One KV block (or state slot). Only the pool mutates it."""

    __slots__ = ("block_id", "group_id", "key", "next", "prev", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: bytes | None = None  # hash + group id, while registered
        self.group_id = -1  # group of the registered key
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.key is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) removal from the middle."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        block = self._head.next
        if block is None or block is self._tail:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def peek(self) -> Block | None:
        block = self._head.next
        return None if block is self._tail else block

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise CacheInvariantError(f"{block} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free -= 1

    def append(self, block: Block) -> None:
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.num_free += 1

    def prepend_n(self, blocks: Sequence[Block]) -> None:
        """Insert at the head, keeping `blocks` in order (blocks[0] becomes the head)."""
        for block in reversed(blocks):
            first = self._head.next
            assert first is not None
            block.prev = self._head
            block.next = first
            first.prev = block
            self._head.next = block
            self.num_free += 1

    def __iter__(self) -> Iterator[Block]:
        block = self._head.next
        while block is not None and block is not self._tail:
            yield block
            block = block.next

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    """All blocks of all groups. Lookups (`get_cached`) never mutate the pool.

    `uncached_to_head`: freed blocks without a hash go to the head of the free queue (recycled
    first, as vLLM v1 does since sparse retention); with False every freed block goes to the
    tail (the plain LRU of SPEC.md 1.2's worked example).
    """

    def __init__(
        self, num_blocks: int, *, uncached_to_head: bool = True, growable: bool = False
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (one is the null block)")
        self.num_blocks = num_blocks
        self.uncached_to_head = uncached_to_head
        self.growable = growable  # an unbounded pool (replays with an infinite cache)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self._cached: dict[bytes, Block | dict[int, Block]] = {}
        self.num_evictions = 0
        self.evictions_by_group: dict[int, int] = {}
        # KV events (events.py): None emits nothing; groups report registrations through it.
        self.events: CacheEvents | None = None
        # The host tier (host_tier.py): None drops what is evicted. `hide_host` makes lookups
        # see the device alone (how much of a hit the host served).
        self.host: HostTier | None = None
        self.hide_host = False

    # ----- public API -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, evictable cached blocks included; the null block excluded."""
        return self.free_queue.num_free

    def has_room(self, num: int) -> bool:
        """Whether `num` more blocks can be handed out now."""
        return self.growable or num <= self.free_queue.num_free

    @property
    def usable_blocks(self) -> int:
        """The blocks a request may hold: all of them but the null block."""
        return self.num_blocks - 1

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.usable_blocks

    def get_cached(self, key: bytes) -> Block | None:
        """Any one block registered under `key` (on the device, else a `HostBlock` of the host
        tier), or None. Does not mutate."""
        entry = self._cached.get(key)
        if entry is None:
            if self.host is None or self.hide_host:
                return None
            return self.host.lookup(key)
        if isinstance(entry, Block):
            return entry
        return next(iter(entry.values()))

    def allocate(self, num: int) -> list[Block]:
        """Pop `num` blocks from the head, evicting any that still carry a hash.

        Raises ValueError if fewer than `num` blocks are free (callers check first).
        """
        if self.growable:
            return self._allocate_growing(num)
        if num > self.free_queue.num_free:
            raise ValueError(f"asked for {num} blocks with {self.free_queue.num_free} free")
        out = []
        host = self.host
        for _ in range(num):
            block = self.free_queue.popleft()
            if block.key is not None:
                if host is not None:
                    host.save(block)
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _allocate_growing(self, num: int) -> list[Block]:
        """An unbounded pool never evicts: it reuses unhashed free blocks, else makes new ones."""
        out = []
        for _ in range(num):
            head = self.free_queue.peek()
            if head is None or head.key is not None:
                self._grow(1)
                block = self.blocks[-1]
                self.free_queue.remove(block)
            else:
                block = self.free_queue.popleft()
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one reference per block (a cache hit); free blocks leave the free queue. A
        host block is skipped: its admission gives it a device block (`KVCacheManager`)."""
        for block in blocks:
            if block is self.null_block or block.block_id < 0:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, ordered: Sequence[Block]) -> None:
        """Drop one reference per block; blocks reaching 0 join the free queue in this order.

        Callers pass a request's blocks in reverse, so its deepest blocks are evicted first.
        """
        with_hash: list[Block] = []
        without_hash: list[Block] = []
        for block in ordered:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise CacheInvariantError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.key is None and self.uncached_to_head:
                    without_hash.append(block)
                else:
                    with_hash.append(block)
        if without_hash:
            self.free_queue.prepend_n(without_hash)
        for block in with_hash:
            self.free_queue.append(block)

    def uncache(self, block: Block) -> bool:
        """Drop the hash of a free block (it stays free), as eviction would on its reuse.
        Returns False, changing nothing, for a held or unhashed block."""
        if block.ref_cnt != 0 or block.key is None:
            return False
        self._evict(block)
        return True

    def register(self, block: Block, key: bytes, group_id: int) -> bool:
        """Record that `block` holds the content named by `key`. Returns False if it already did.

        There is no deduplication: several blocks may carry the same key.
        """
        if block is self.null_block:
            raise CacheInvariantError("the null block is never registered")
        if block.key is not None:
            if block.key == key:
                return False
            raise CacheInvariantError(f"{block} is already registered under another key")
        block.key = key
        block.group_id = group_id
        entry = self._cached.get(key)
        if entry is None:
            self._cached[key] = block
        elif isinstance(entry, Block):
            self._cached[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Drop every registration (vLLM's reset_prefix_cache). Refused, returning False and
        changing nothing, while any block is held: a running request's blocks stay valid."""
        if any(b.ref_cnt for b in self.blocks[1:]):
            return False
        for block in self.blocks[1:]:
            if block.key is not None:
                block.key = None
                block.group_id = -1
        self._cached.clear()
        if self.host is not None:
            self.host.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def unregister(self, block: Block) -> None:
        """Drop `block`'s registration (a partial tail superseded by its full block)."""
        if block.key is not None:
            self._drop_key(block)

    def unregister_key(self, key: bytes) -> int:
        """Drop `key` from every device block registered under it, held or free (free blocks
        keep their place in the free queue). Returns how many blocks carried it."""
        entry = self._cached.get(key)
        if entry is None:
            return 0
        blocks = [entry] if isinstance(entry, Block) else list(entry.values())
        for block in blocks:
            self._drop_key(block)
        return len(blocks)

    # ----- internals --------------------------------------------------------------------------

    def _grow(self, num: int) -> None:
        new = [Block(i) for i in range(self.num_blocks, self.num_blocks + num)]
        self.blocks.extend(new)
        self.num_blocks += num
        for block in new:
            self.free_queue.append(block)

    def _evict(self, block: Block) -> None:
        self.num_evictions += 1
        self.evictions_by_group[block.group_id] = self.evictions_by_group.get(block.group_id, 0) + 1
        self._drop_key(block)

    def _drop_key(self, block: Block) -> None:
        key = block.key
        assert key is not None
        if self.events is not None:
            self.events.removed(key, block.group_id)
        entry = self._cached[key]
        if isinstance(entry, Block):
            del self._cached[key]
        else:
            del entry[block.block_id]
            if len(entry) == 1:
                self._cached[key] = next(iter(entry.values()))
        block.key = None
        block.group_id = -1

    def check_invariants(self) -> None:
        """Raise CacheInvariantError on any broken pool invariant (SPEC.md section 8, 2-3)."""
        free_ids = set()
        for block in self.free_queue:
            if block.ref_cnt != 0:
                raise CacheInvariantError(f"{block} is in the free queue with a reference")
            if block.block_id in free_ids:
                raise CacheInvariantError(f"{block} appears twice in the free queue")
            free_ids.add(block.block_id)
        if len(free_ids) != self.free_queue.num_free:
            raise CacheInvariantError("free-queue length disagrees with its counter")
        if 0 in free_ids or self.null_block.key is not None:
            raise CacheInvariantError("the null block was freed or hashed")
        referenced = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        if any(b.ref_cnt < 0 for b in self.blocks):
            raise CacheInvariantError("negative ref count")
        if len(free_ids) + referenced + 1 != self.num_blocks:
            raise CacheInvariantError(
                f"free {len(free_ids)} + referenced {referenced} + null != {self.num_blocks}"
            )
        num_keyed = 0
        for key, entry in self._cached.items():
            members = [entry] if isinstance(entry, Block) else list(entry.values())
            for block in members:
                num_keyed += 1
                if block.key != key:
                    raise CacheInvariantError(f"{block} is mapped under a key it does not carry")
        if num_keyed != sum(1 for b in self.blocks if b.key is not None):
            raise CacheInvariantError("a hashed block is unreachable from the hash map")
