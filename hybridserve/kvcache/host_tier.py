"""The host tier: a second pool, in host memory, that cached blocks go to instead of being
dropped, and come back from on a hit.

A host slot holds one block of one group (a full-attention or window block, or a state slot:
the device pool's pages are one size, so the host's are too). Two ways in:

* **on eviction** (the default): when the device pool hands out a free block that still
  carries a hash, its content is saved to a host slot first and its key moves to the host;
* **write-through** (`write_through`, vLLM's offloading connector): every block is saved once
  it is computed (the step after the one that registered it), so an eviction costs no copy;
  the host then holds copies of device blocks too.

A lookup finds a key on the device first, then on the host: `BlockPool.get_cached` returns a
`HostBlock` for a host key, which the groups' lookups treat as any cached block. Admitting a
hit promotes its host blocks: each takes a new device block, is registered there, and a load
(host slot -> device block) is queued. A promoted key leaves the host (the tiers are exclusive
on eviction; write-through keeps the host copy). The host keeps its entries in LRU order and
drops the least recently stored when it needs a slot.

Transfers are queued here and taken once per step (`take_transfers`): the executor runs every
save, then every load, before the step's copies and its forward, so a slot saved and promoted
in one step is read after it is written, and a device block reused in the step is saved before
it is overwritten. A slot freed by a promotion is reused only from the next step on: its load
has run by then.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from hybridserve.core.errors import CacheInvariantError
from hybridserve.core.plan import HostCopy
from hybridserve.kvcache.block_pool import Block

HostListener = Callable[[bytes, int, bool], None]


class HostBlock(Block):
    """What a lookup finds for a key held on the host: a placeholder with no device block
    (`block_id` -1) that an admission replaces with a device block and a load."""

    __slots__ = ("slot",)

    def __init__(self, slot: int, key: bytes, group_id: int) -> None:
        super().__init__(-1)
        self.slot = slot
        self.key = key
        self.group_id = group_id

    def __repr__(self) -> str:
        return f"HostBlock(slot={self.slot}, group={self.group_id})"


@dataclass(slots=True)
class HostStats:
    """Blocks saved to the host, loaded back, dropped from it (its own LRU), copies skipped
    because the host already held the key, and saves refused (every slot claimed)."""

    saved: int = 0
    loaded: int = 0
    dropped: int = 0
    already_held: int = 0
    refused: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "saved": self.saved,
            "loaded": self.loaded,
            "dropped": self.dropped,
            "already_held": self.already_held,
            "refused": self.refused,
        }


class HostTier:
    """`num_slots` host blocks: their keys in LRU order, free slots, and the step's transfers."""

    def __init__(
        self, num_slots: int, *, write_through: bool = False, loads_per_step: int = 0
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots}: a host tier needs at least one slot")
        if loads_per_step < 0:
            raise ValueError(f"loads_per_step={loads_per_step}: use 0 (no cap) or more")
        self.num_slots = num_slots
        self.write_through = write_through
        # Background loads (prefetches) a plan carries at most; 0: all that are queued.
        self.loads_per_step = loads_per_step
        self._entries: OrderedDict[bytes, HostBlock] = OrderedDict()  # least recent first
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 is used first
        self._releasing: list[int] = []  # freed by a load this step; reusable next step
        self._saves: list[HostCopy] = []
        self._loads: list[HostCopy] = []
        # Prefetch loads: queued, planned `loads_per_step` at a time, beside the forward; a
        # block planned in a step is read from the next one on (`in_flight` until then).
        # (load, slot to release or -1, key)
        self._queued: deque[tuple[HostCopy, int, bytes]] = deque()
        self._queued_keys: dict[bytes, int] = {}  # kept keys (write-through) a queued load reads
        self._queued_blocks: set[int] = set()
        self._in_flight: set[int] = set()
        # Write-through saves of blocks registered this step (computed by its forward): they
        # run with the next step's transfers, after that forward.
        self._computing: list[HostCopy] = []
        self._computed: list[HostCopy] = []
        self._unsaved: set[bytes] = set()  # the keys of `_computing`: not loadable yet
        # Saves ahead of eviction (free blocks next in line), and the blocks this step evicts:
        # a background copy of one of those must finish before the forward reuses it.
        self._ahead: list[HostCopy] = []
        self._evicted: set[int] = set()
        # Set while a prefetch takes device blocks: what they evict is saved beside the
        # forward too (the block is written by the prefetch's load, after the save, on the copy
        # stream; the forward does not touch it).
        self.prefetching = False
        self._next: set[bytes] = set()  # the keys of `_computed`: saved by the next plan
        # The save still to run into each slot: a key dropped before its save ran cancels it
        # (its slot may be saved into again, and the older copy must not land after that).
        self._pending: dict[int, HostCopy] = {}
        # Keys an admission is promoting this step: never dropped before their loads run.
        self._claimed: set[bytes] = set()
        self.stats = HostStats()
        # KV events: called with (key, group_id, stored) as keys enter and leave the host.
        self.on_change: HostListener | None = None

    # ----- queries ----------------------------------------------------------------------------

    def lookup(self, key: bytes) -> HostBlock | None:
        """The host block under `key`; None for a key whose save has not been planned yet (a
        write-through save of a block this step computes)."""
        if key in self._unsaved:
            return None
        return self._entries.get(key)

    def is_saved(self, key: bytes) -> bool:
        """Whether the key's content is in its slot once the last plan's saves have run."""
        return key in self._entries and key not in self._unsaved and key not in self._next

    @property
    def num_used(self) -> int:
        """Slots holding a key or waiting for a load to finish."""
        return len(self._entries) + len(self._releasing) + len(self._queued_slots())

    def _queued_slots(self) -> list[int]:
        return [slot for _, slot, _ in self._queued if slot >= 0]

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    # ----- changes ----------------------------------------------------------------------------

    def save(self, block: Block, *, computed: bool = True, ahead: bool = False) -> None:
        """Copy a hashed device block's content to a host slot under its key: at its eviction
        (`computed`: the copy runs before the step reuses the block), ahead of its eviction
        (`ahead`: a free block next in line, copied beside the forward), or at its registration
        under write-through (the copy runs after the step computes it). A key the host holds
        already is only touched; its eviction makes a copy still to run a blocking one."""
        key = block.key
        if key is None:
            raise CacheInvariantError(f"{block} has no key to save under")
        beside = ahead or not computed or self.prefetching
        copy = self._store(block, key, block.group_id, beside=beside)
        if copy is None:
            return
        if ahead or (computed and self.prefetching):
            self._ahead.append(copy)
        else:
            (self._saves if computed else self._computing).append(copy)
        if not computed:
            self._unsaved.add(key)

    def save_as(self, block: Block, key: bytes, group_id: int) -> bool:
        """Copy an unregistered device block of `group_id` that is being freed (a turn's exact
        end: a partial last block or a running state) to a host slot under `key`, a tail key,
        before the step reuses the block. False when no slot could be had."""
        if block.key is not None:
            raise CacheInvariantError(f"{block} is registered: save it under its own key")
        copy = self._store(block, key, group_id, beside=False)
        if copy is not None:
            self._saves.append(copy)
        return key in self._entries

    def _store(self, block: Block, key: bytes, group_id: int, *, beside: bool) -> HostCopy | None:
        """Give `key` a host slot and the copy from `block` into it (None: no copy to run, the
        host holds the key already or has no slot to give)."""
        if not beside:
            self._evicted.add(block.block_id)
        held = self._entries.get(key)
        if held is not None:
            self._entries.move_to_end(key)
            self.stats.already_held += 1
            return None
        if not self._free and not self._drop_oldest():
            self.stats.refused += 1
            return None
        slot = self._free.pop()
        self._entries[key] = HostBlock(slot, key, group_id)
        copy = HostCopy(group_id, block.block_id, slot, background=beside)
        self._pending[slot] = copy
        self.stats.saved += 1
        if self.on_change is not None:
            self.on_change(key, group_id, True)
        return copy

    def load(self, host_block: HostBlock, device_block: Block, *, prefetch: bool = False) -> None:
        """Queue the copy of a host block into `device_block`, which now carries its key. The
        entry leaves the host (a write-through host keeps it, as a copy of the device block).
        A load runs before the step's forward; a `prefetch` runs beside a later one (at most
        `loads_per_step` a step) and its block is not ready until the step after."""
        key = host_block.key
        if key is None or self._entries.get(key) is not host_block:
            raise CacheInvariantError(f"{host_block} is not on the host")
        copy = HostCopy(host_block.group_id, device_block.block_id, host_block.slot, prefetch)
        self.stats.loaded += 1
        keep = self.write_through
        if prefetch:
            self._queued.append((copy, -1 if keep else host_block.slot, key))
            self._queued_blocks.add(device_block.block_id)
            if keep:
                self._queued_keys[key] = self._queued_keys.get(key, 0) + 1
        else:
            self._loads.append(copy)
        if keep:
            self._entries.move_to_end(key)
            return
        del self._entries[key]
        self._claimed.discard(key)
        if not prefetch:
            self._releasing.append(host_block.slot)
        if self.on_change is not None:
            self.on_change(key, host_block.group_id, False)

    def is_loading(self, block_id: int) -> bool:
        """Whether a prefetch into this device block has not completed yet."""
        return block_id in self._queued_blocks or block_id in self._in_flight

    @property
    def num_queued_loads(self) -> int:
        return len(self._queued)

    def new_step(self) -> None:
        """The last plan has run: its prefetches are complete."""
        self._in_flight.clear()

    def claim(self, host_block: HostBlock) -> None:
        """Hold a host block an admission will load this step: the saves its allocations queue
        drop other keys first, and none may reuse its slot before the load has run."""
        key = host_block.key
        if key is None or self._entries.get(key) is not host_block:
            raise CacheInvariantError(f"{host_block} is not on the host")
        self._claimed.add(key)

    def take_transfers(self) -> tuple[tuple[HostCopy, ...], tuple[HostCopy, ...]]:
        """The step's saves (write-through copies of the last step's blocks first) and loads,
        in order; slots freed by its loads become reusable."""
        background = [c for c in (*self._computed, *self._ahead) if self._runs(c)]
        evicted = self._evicted
        read_now = {c.slot for c in self._loads}
        if read_now:  # a slot a blocking load reads is written before the forward
            background = [
                replace(c, background=False) if c.slot in read_now else c for c in background
            ]
            evicted = evicted | {c.block_id for c in background if c.slot in read_now}
        saves = (
            *(replace(c, background=False) for c in background if c.block_id in evicted),
            *(c for c in self._saves if self._runs(c)),
            *(c for c in background if c.block_id not in evicted),
        )
        self._ahead.clear()
        self._evicted = set()
        loads = [*self._loads]
        cap = self.loads_per_step or len(self._queued)
        while self._queued and cap > 0:
            copy, slot, key = self._queued.popleft()
            self._queued_blocks.discard(copy.block_id)
            self._release_queued_key(key)
            self._in_flight.add(copy.block_id)
            if slot >= 0:
                self._releasing.append(slot)
            loads.append(copy)
            cap -= 1
        self._computed, self._computing = self._computing, []
        self._next, self._unsaved = self._unsaved, set()
        self._saves.clear()
        self._loads.clear()
        self._free.extend(reversed(self._releasing))
        self._releasing.clear()
        self._claimed.clear()
        return saves, tuple(loads)

    def _release_queued_key(self, key: bytes) -> None:
        count = self._queued_keys.get(key, 0)
        if count > 1:
            self._queued_keys[key] = count - 1
        elif count:
            del self._queued_keys[key]

    def cancel_loads(self, block_ids: set[int]) -> None:
        """Take back the queued loads into these device blocks (a prefetch let go of them
        before they ran): their keys stay on the host, in the slots they were read from."""
        kept: deque[tuple[HostCopy, int, bytes]] = deque()
        for copy, slot, key in self._queued:
            if copy.block_id not in block_ids:
                kept.append((copy, slot, key))
                continue
            self._queued_blocks.discard(copy.block_id)
            self.stats.loaded -= 1
            if slot < 0:
                self._release_queued_key(key)
            elif key not in self._entries:
                self._entries[key] = HostBlock(slot, key, copy.group_id)
                if self.on_change is not None:
                    self.on_change(key, copy.group_id, True)
            else:
                self._free.append(slot)  # the key came back in another slot meanwhile
        self._queued = kept

    def _runs(self, copy: HostCopy) -> bool:
        """Whether a queued save still runs (its key was not dropped); taken off the pending."""
        if self._pending.get(copy.slot) is not copy:
            return False
        del self._pending[copy.slot]
        return True

    def clear(self) -> None:
        """Drop every key (a prefix-cache reset). Queued transfers still run."""
        for key, entry in list(self._entries.items()):
            self._free.append(entry.slot)
            if self.on_change is not None:
                self.on_change(key, entry.group_id, False)
        self._entries.clear()

    def forget_key(self, key: bytes) -> bool:
        """Drop `key` if the host holds it and no admission or queued load needs it (a turn's
        exact end that was used or superseded). Returns whether it was dropped."""
        if key not in self._entries or key in self._claimed or key in self._queued_keys:
            return False
        self._drop(key)
        return True

    def forget(self, slots: set[int]) -> int:
        """Drop the keys held in `slots` (their saves did not run; call once the prefetches
        that read them are released). Returns how many."""
        dropped = [key for key, entry in self._entries.items() if entry.slot in slots]
        for key in dropped:
            self._drop(key)
        return len(dropped)

    def forget_blocks(self, block_ids: set[int]) -> int:
        """Drop the keys whose save still to run reads one of these device blocks (a failed
        step's: their content is unknown). Returns how many."""
        slots = {slot for slot, copy in self._pending.items() if copy.block_id in block_ids}
        return self.forget(slots) if slots else 0

    def _drop_oldest(self) -> bool:
        """Free the slot of the least recently stored key that no admission claims."""
        for key in self._entries:
            if key not in self._claimed and key not in self._queued_keys:
                break
        else:
            return False
        self._drop(key)
        return True

    def _drop(self, key: bytes) -> None:
        """Give up `key`: its slot is free again and a save still to run into it is cancelled."""
        entry = self._entries.pop(key)
        self._pending.pop(entry.slot, None)
        self._free.append(entry.slot)
        self.stats.dropped += 1
        if self.on_change is not None:
            self.on_change(key, entry.group_id, False)

    # ----- invariants -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Every slot is exactly one of: holding a key, waiting on a load, free."""
        held = [e.slot for e in self._entries.values()]
        every = held + self._releasing + self._queued_slots() + self._free
        if sorted(every) != list(range(self.num_slots)):
            raise CacheInvariantError(
                f"host slots are not partitioned: {len(held)} held, "
                f"{len(self._releasing) + len(self._queued)} loading, {len(self._free)} free of "
                f"{self.num_slots}"
            )
        for key, entry in self._entries.items():
            if entry.key != key or entry.ref_cnt != 0:
                raise CacheInvariantError(f"{entry} is mapped under a key it does not carry")
