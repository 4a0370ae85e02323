"""The GroupManager base: per-request block tables, allocation, registration, freeing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridserve.core.errors import CacheInvariantError
from hybridserve.kvcache.block_pool import Block, BlockPool
from hybridserve.kvcache.hashing import BlockHash, cache_key
from hybridserve.kvcache.spec import GroupKind, GroupSpec


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class SlotRequest:
    """What one allocation asks of every group."""

    num_slots: int  # slots to hold: computed + new + lookahead tokens
    computed: int  # tokens computed before this chunk (a new request's hit included)
    chunk_end: int  # computed + new tokens (lookahead excluded)
    seq_tokens: int  # the request's known tokens (prompt + output)
    keep: KeepMask | None = None  # the request's retention mask (where checkpoints are kept)
    admission: bool = False  # the full-sequence admission gate (recycling groups are capped)
    # The chunk's leading tokens arrived computed from another engine (a P/D handoff): the
    # sender materialised their states, so a state group keeps the chunk's prefill checkpoint
    # as if its spec had one.
    received: bool = False


@dataclass(frozen=True, slots=True)
class GroupContext:
    """What a group manager needs to know about its place in the layout."""

    group_id: int
    unit: int  # lookup unit U_g in tokens (block size times DCP width when sharded)
    hash_ratio: int  # U_g / H: base hashes per block of this group
    alignment: int  # A
    drops_tail: bool  # loses one A of its hit under a tail-dropping speculative method
    eagle_drop: bool = False  # some group drops its tail (vLLM's use_eagle_block_drop)
    # Sliding-window groups: the most blocks the admission gate counts for one request (vLLM's
    # max_admission_blocks_per_request); 0 = no cap.
    admission_cap: int = 0
    # Fine-grained hits (vLLM's enable_partial_hash_hits): states and attention blocks are also
    # registered at the last A boundary inside a block (a partial tail).
    partial_hits: bool = False
    # vLLM's scheduler block (the lcm of the groups' block sizes): the segment a sliding-window
    # group's dense registration mask works in.
    segment: int = 0


class GroupLookup:
    """A prepared lookup of one request's hashes in one group. Never mutates the pool.

    `serve(limit, drop)` returns the largest length L <= limit, a multiple of A, at which the
    group can resume the request (0 always qualifies). With `drop` the group needs one extra A of
    cached content past L (its tail is recomputed). `blocks(L)` gives the block list for a
    resume at L (null blocks for skipped positions) and the copy-on-write source when L ends
    inside a block.
    """

    def serve(self, limit: int, drop: bool) -> int:
        raise NotImplementedError

    def blocks(self, length: int) -> tuple[list[Block], Block | None]:
        raise NotImplementedError


class GroupManager:
    """Owns one group's per-request block tables over the shared pool."""

    kind: GroupKind

    def __init__(self, spec: GroupSpec, ctx: GroupContext, pool: BlockPool) -> None:
        self.spec = spec
        self.ctx = ctx
        self.pool = pool
        self.block_size = ctx.unit
        self.tables: dict[str, list[Block]] = {}
        self.num_processed: dict[str, int] = {}  # block indices already considered for registry
        self.num_registered = 0
        self.cow_holds: list[Block] = []  # copy-on-write sources referenced until the next step
        self.key_suffix = cache_key(b"", ctx.group_id)  # cache key = hash + this suffix

    # ----- lookup -----------------------------------------------------------------------------

    def lookup(
        self, hashes: Sequence[BlockHash], cap: int, *, base: Sequence[BlockHash] = ()
    ) -> GroupLookup:
        """Prepare a lookup over `hashes` (at this group's unit) for lengths <= cap; `base` are
        the hashes at H (for partial-tail keys)."""
        raise NotImplementedError

    @property
    def eagle_margin(self) -> int:
        """How far past a candidate the coordinator asks this group when it drops its tail:
        the unit it drops (A here; a sliding window drops one block of its own)."""
        return self.ctx.alignment

    def _cached(self, hashes: Sequence[BlockHash], index: int) -> Block | None:
        if index >= len(hashes):
            return None
        return self.pool.get_cached(hashes[index] + self.key_suffix)

    # ----- allocation -------------------------------------------------------------------------

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose blocks a request no longer needs once it computed this many."""
        return 0

    def settled(self, req_id: str, num_slots: int, num_to_cache: int, computed: int) -> bool:
        """True if allocating `num_slots` for a running request would change nothing here:
        the table already holds them, no block becomes full and nothing is released.
        The scheduler's per-step fast path (most decode steps of most requests)."""
        return False

    def num_blocks_needed(
        self, req_id: str, slots: SlotRequest, hit: Sequence[Block], cow_src: Block | None
    ) -> int:
        """Blocks this group must take from the free queue to hold `num_tokens` slots.

        Touching a hit block with ref count 0 takes it out of the free queue, so it counts; a
        copy-on-write tail costs its new block, and its source while that is held for the copy.
        """
        table = self.tables.get(req_id, ())
        held = max(len(hit) + len(table), self.skipped_tokens_for_new(req_id, hit))
        if cow_src is not None:
            held += 1
        required = cdiv(slots.num_slots, self.block_size)
        if slots.admission and self.ctx.admission_cap:
            required = min(required, self.ctx.admission_cap)
        new = max(required - held, 0)
        return new + _num_evictable(hit, self.pool) + _cow_cost(cow_src)

    def skipped_tokens_for_new(self, req_id: str, hit: Sequence[Block]) -> int:
        return 0

    def add_hit(self, req_id: str, hit: Sequence[Block], cow_src: Block | None) -> None:
        """Start a request's table with its prefix hit: take a reference on every hit block
        (and on a copy-on-write source, held until the copy has run). Allocates nothing, so
        every group's hit is held before any group takes a new block."""
        if req_id in self.tables:
            raise CacheInvariantError(f"request {req_id!r} already holds blocks in this group")
        self.pool.touch(hit)
        if cow_src is not None:
            self.pool.touch((cow_src,))
            self.cow_holds.append(cow_src)
        self.tables[req_id] = list(hit)
        # Hit blocks are registered already.
        self.num_processed[req_id] = len(hit)

    def add_copy_target(self, req_id: str) -> Block:
        """The new block a copy-on-write tail continues in (not full: not registered)."""
        block = self.pool.allocate(1)[0]
        self.tables[req_id].append(block)
        return block

    def allocate(self, req_id: str, slots: SlotRequest) -> list[Block]:
        """Grow the table to hold `slots.num_slots` slots. The caller checked capacity."""
        table = self.tables.setdefault(req_id, [])
        self.num_processed.setdefault(req_id, 0)
        num_new = cdiv(slots.num_slots, self.block_size) - len(table)
        if num_new <= 0:
            return []
        blocks = self.pool.allocate(num_new)
        table.extend(blocks)
        return blocks

    def remove_skipped(self, req_id: str, num_computed_tokens: int) -> None:
        """Release blocks outside what the request still needs (window, old states)."""
        table = self.tables.get(req_id)
        if not table:
            return
        end = min(self.skipped_tokens(num_computed_tokens) // self.block_size, len(table))
        self._release(table, range(end - 1, -1, -1))

    def _release(self, table: list[Block], indices: Sequence[int] | range) -> None:
        freed = []
        null = self.pool.null_block
        for index in indices:
            block = table[index]
            if block is null:
                break
            table[index] = null
            freed.append(block)
        if freed:
            self.pool.free(freed)

    def free(self, req_id: str) -> None:
        """Drop the request's references, deepest block first."""
        table = self.tables.pop(req_id, None)
        self.num_processed.pop(req_id, None)
        if table:
            self.pool.free(table[::-1])

    # ----- registration -----------------------------------------------------------------------

    def register(
        self,
        req_id: str,
        hashes: Sequence[BlockHash],
        num_tokens_to_cache: int,
        *,
        chunk_end: int,
        keep: KeepMask,
        base: Sequence[BlockHash] = (),
    ) -> int:
        """Register newly full blocks up to `num_tokens_to_cache`; returns how many. `base` are
        the request's hashes at H (partial tails are keyed by them)."""
        table = self.tables.get(req_id)
        if table is None:
            return 0
        start = self.num_processed[req_id]
        end = min(num_tokens_to_cache // self.block_size, len(table), len(hashes))
        if end <= start:
            return 0
        null, events, unit = self.pool.null_block, self.pool.events, self.block_size
        count = 0
        for index in range(start, end):
            block = table[index]
            if block is null or not self._should_register(req_id, index, chunk_end, keep):
                continue
            if self.pool.register(block, hashes[index] + self.key_suffix, self.ctx.group_id):
                count += 1
                self._on_registered(hashes[index])
                if events is not None:
                    parent = hashes[index - 1] if index else None
                    start_token = index * unit
                    events.stored(
                        self.ctx.group_id,
                        hashes[index],
                        parent,
                        req_id,
                        start_token,
                        start_token + unit,
                    )
        self.num_processed[req_id] = end
        self.num_registered += count
        return count

    def _should_register(self, req_id: str, index: int, chunk_end: int, keep: KeepMask) -> bool:
        return True

    def _partial_stored(self, req_id: str, position: int, base: Sequence[BlockHash]) -> None:
        """Report a partial tail registered at `position` (inside block position // unit) to
        the KV events, if any: its tokens from the block's start, its parent the block before."""
        events = self.pool.events
        if events is None:
            return
        index, ratio = position // self.block_size, self.ctx.hash_ratio
        h = self.block_size // ratio
        parent = base[index * ratio - 1] if index else None
        events.stored(
            self.ctx.group_id,
            base[position // h - 1],
            parent,
            req_id,
            index * self.block_size,
            position,
        )

    def _on_registered(self, block_hash: BlockHash) -> None:
        return None

    def new_step(self) -> None:
        if self.cow_holds:
            self.pool.free(self.cow_holds)
            self.cow_holds = []

    def held_outside_tables(self) -> list[Block]:
        """Blocks this group references outside the request tables (copy-on-write sources)."""
        return list(self.cow_holds)


class KeepMask:
    """Which positions a retention keeps for one request (see retention.py)."""

    __slots__ = (
        "dense",
        "dropped_window_positions",
        "interval",
        "state_positions",
        "window_positions",
    )

    def __init__(
        self,
        *,
        dense: bool,
        interval: int,
        state_positions: tuple[int, ...],
        window_positions: tuple[int, ...],
        dropped_window_positions: tuple[int, ...] = (),
    ) -> None:
        self.dense = dense
        self.interval = interval
        self.state_positions = state_positions
        self.window_positions = window_positions
        # Landings only a tail-dropping window group keeps (vLLM 0.33: one block below a
        # shared-prefix junction, where a sibling diverging right after it lands).
        self.dropped_window_positions = dropped_window_positions

    def keeps_position(self, position: int) -> bool:
        """Whether a state snapshot at `position` is kept."""
        if self.dense or position in self.state_positions:
            return True
        return self.interval > 0 and position % self.interval == 0

    def keeps_range(
        self, start: int, end: int, lookback: int, lookahead: int, *, drops: bool = False
    ) -> bool:
        """Whether tokens [start, end) are needed to resume at a kept position p, that is whether
        they intersect [p - lookback, p + lookahead) for some kept p (with `drops`, the group
        drops its tail and also keeps the dropped window positions)."""
        if self.dense:
            return True
        positions = self.window_positions
        if drops and self.dropped_window_positions:
            positions = (*positions, *self.dropped_window_positions)
        for p in positions:
            if p - lookback < end and start < p + lookahead:
                return True
        if self.interval > 0:
            # The smallest interval position whose window can reach past `start`.
            p = (start - lookahead) // self.interval * self.interval + self.interval
            if p > 0 and p - lookback < end:
                return True
        return False


def _cow_cost(cow_src: Block | None) -> int:
    if cow_src is None:
        return 0
    return 2 if cow_src.ref_cnt == 0 else 1


def _num_evictable(hit: Sequence[Block], pool: BlockPool) -> int:
    null = pool.null_block
    return sum(1 for b in hit if b.ref_cnt == 0 and b is not null)
