"""KVCacheManager: reconciled lookup, per-group allocation, registration, freeing, invariants.

The scheduler-facing API. It takes ids, hashes and lengths, never a Request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from hybridserve.core.errors import CacheInvariantError
from hybridserve.core.plan import BlockCopy, HostCopy
from hybridserve.kvcache.block_pool import Block, BlockPool
from hybridserve.kvcache.coordinator import Reconciliation, reconcile
from hybridserve.kvcache.groups import GroupContext, GroupManager, make_manager
from hybridserve.kvcache.groups.base import KeepMask, SlotRequest
from hybridserve.kvcache.groups.mamba import MambaManager
from hybridserve.kvcache.hashing import BlockHash, BlockHasher, derived_hashes
from hybridserve.kvcache.host_tails import HostTails
from hybridserve.kvcache.host_tier import HostBlock, HostTier
from hybridserve.kvcache.layout import CacheLayout
from hybridserve.kvcache.metrics import AdmissionSample, CacheMetrics
from hybridserve.kvcache.pins import PinStats, PinTable, exact_tail
from hybridserve.kvcache.retention import RetentionKind
from hybridserve.kvcache.spec import GroupKind, MambaCacheMode, MambaSpec, SlidingWindowSpec


@dataclass(frozen=True, slots=True)
class CacheHit:
    """A reconciled prefix hit. Valid until the pool next changes: allocate it at once.

    `ready` is False when a state it needs was registered in this step; such a request must
    wait a step (allocate refuses it). `junction` is the full-attention match length when it
    exceeds the hit: a shared prefix whose states are missing, retained from now on.
    """

    num_tokens: int
    group_blocks: tuple[tuple[Block, ...], ...]
    cow_sources: tuple[Block | None, ...]
    ready: bool
    junction: int
    sample: AdmissionSample | None
    from_tail: bool = False  # the exact end of a session's pinned turn (`session_hit`)


@dataclass(frozen=True, slots=True)
class Allocation:
    """What one allocation added: new block ids per group, and copies to run first."""

    new_block_ids: tuple[tuple[int, ...], ...]
    block_copies: tuple[BlockCopy, ...]


@dataclass(slots=True)
class _RequestState:
    num_prompt_tokens: int
    boundaries: tuple[int, ...]
    keep: KeepMask


class KVCacheManager:
    """All groups of one model over one BlockPool."""

    def __init__(
        self,
        layout: CacheLayout,
        *,
        enable_caching: bool = True,
        enable_metrics: bool = True,
        uncached_to_head: bool = True,
        unbounded: bool = False,
    ) -> None:
        self.layout = layout
        self.enable_caching = enable_caching
        self.enable_metrics = enable_metrics
        self.pool = BlockPool(
            layout.num_blocks, uncached_to_head=uncached_to_head, growable=unbounded
        )
        self.hasher = BlockHasher(
            layout.hash_block_size,
            layout.hash_algo,
            lookahead=layout.speculative.hash_lookahead_tokens,
        )
        self.groups = _build_groups(layout, self.pool)
        self._drops = tuple(layout.drops_tail(g) for g in range(layout.num_groups))
        self._margins = tuple(g.eagle_margin for g in self.groups)
        self._full_groups = [
            g for g, s in enumerate(layout.groups) if s.kind in (GroupKind.FULL, GroupKind.MLA)
        ]
        self._hybrid = layout.num_groups > 1
        # vLLM's scheduler block: the lcm of the groups' own block sizes (before DCP sharding).
        self._scheduler_block = math.lcm(*(g.block_size for g in layout.groups))
        # Align-mode state groups with a prefill checkpoint place it by the retention mask.
        self._checkpointing = any(
            isinstance(s, MambaSpec) and s.prefill_checkpoint for s in layout.groups
        )
        self._requests: dict[str, _RequestState] = {}
        self._no_change = Allocation(((),) * len(self.groups), ())
        # Positions a state or window group can resume at lie on lcm(A, its block size).
        self._serving_grids = _grids(
            layout, [g.block_size for g in self.groups if g.kind in _SERVING_KINDS]
        )
        self._state_grids = _grids(
            layout,
            [
                s.block_size
                for s in layout.groups
                if isinstance(s, MambaSpec) and s.mode is MambaCacheMode.ALIGN
            ],
        )
        self.metrics = CacheMetrics(tuple(s.kind.value for s in layout.groups))
        # Tool-call pins (off unless a scheduler pins).
        self.pins = PinTable(self.pool)
        self.host: HostTier | None = None
        # Exact ends of released pins, kept through the host tier (host_tails.py).
        self.host_tails: HostTails | None = None
        if layout.host_blocks and enable_caching and not unbounded:
            self._attach_host()
        self._prefetch: dict[str, list[Block]] = {}  # req_id -> blocks its prefetch holds
        self._prefetched_tokens: dict[str, int] = {}  # req_id -> host hit tokens it loads

    def _attach_host(self) -> None:
        """The host tier, and the turn ends it keeps for sessions whose pins went."""
        layout = self.layout
        self.host = HostTier(
            layout.host_blocks,
            write_through=layout.host_write_through,
            loads_per_step=layout.host_loads_per_step,
        )
        self.pool.host = self.host
        self.host_tails = HostTails(self.pool, self.host, self.pins.stats)
        self.pins.on_release = self.host_tails.keep

    # ----- lookup (never mutates) -------------------------------------------------------------

    def find_hit(
        self,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        *,
        resumed: bool = False,
        device_only: bool = False,
    ) -> CacheHit:
        """The reconciled hit for a sequence of `num_tokens` tokens with these hashes.

        The lookup cap is num_tokens - 1: one token is always recomputed for its logits.
        Does not mutate the pool; the metrics sample is committed only by `allocate`.
        `device_only`: the hit without the host tier's blocks.
        """
        if device_only and self.host is not None and not self.pool.hide_host:
            self.pool.hide_host = True
            try:
                return self.find_hit(block_hashes, num_tokens, resumed=resumed)
            finally:
                self.pool.hide_host = False
        layout, cap = self.layout, num_tokens - 1
        if not self.enable_caching or cap < layout.alignment_tokens:
            return self._empty_hit(num_tokens, resumed)
        # A hybrid layout lets an EAGLE group look past the cap, up to the hashed length.
        reach = len(block_hashes) * layout.hash_block_size if self._hybrid else cap
        lookups = [
            g.lookup(
                derived_hashes(block_hashes, g.ctx.hash_ratio),
                reach if g.ctx.drops_tail else cap,
                base=block_hashes,
            )
            for g in self.groups
        ]
        rec = reconcile(
            lookups,
            self._drops,
            alignment=layout.alignment_tokens,
            cap=cap,
            reach=reach,
            margins=self._margins,
        )
        group_blocks, cows = [], []
        for lookup in lookups:
            blocks, cow = lookup.blocks(rec.num_tokens)
            group_blocks.append(tuple(blocks))
            cows.append(cow)
        ready = self._ready(group_blocks, cows)
        # The shared-prefix junction: the longest full-attention hit after the EAGLE drop, when
        # it exceeds the reconciled hit (vLLM's shared_prefix_boundary).
        junction = 0
        if self._full_groups:
            longest = max(rec.offered[g] for g in self._full_groups)
            junction = longest if longest > rec.num_tokens else 0
        sample = None
        if self.enable_metrics:
            host_tokens = 0
            if self.host is not None and _holds_host_blocks(group_blocks, cows):
                host_tokens = rec.num_tokens - self._device_hit(block_hashes, num_tokens)
            sample = self._sample(num_tokens, rec, resumed=resumed, host_tokens=host_tokens)
        return CacheHit(rec.num_tokens, tuple(group_blocks), tuple(cows), ready, junction, sample)

    def _sample(
        self, num_tokens: int, rec: Reconciliation, *, resumed: bool, host_tokens: int
    ) -> AdmissionSample:
        return AdmissionSample(
            queried_tokens=num_tokens,
            cacheable_tokens=self.cacheable_tokens(num_tokens),
            hit_tokens=rec.num_tokens,
            group_offered_tokens=rec.offered,
            limiting_group=rec.limiting_group,
            resumed=resumed,
            host_hit_tokens=host_tokens,
        )

    def _ready(self, group_blocks: Sequence[Sequence[Block]], cows: Sequence[Block | None]) -> bool:
        """A hit is ready unless it needs a state registered this step or a block whose
        prefetch has not completed."""
        for group, blocks in zip(self.groups, group_blocks, strict=True):
            if isinstance(group, MambaManager) and blocks and group.is_fresh(blocks[-1]):
                return False
        return self.host is None or not self._loading(group_blocks, cows)

    def _device_hit(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> int:
        """The reconciled hit the device alone would serve (the rest of a hit is the host's)."""
        return self.find_hit(block_hashes, num_tokens, device_only=True).num_tokens

    @staticmethod
    def needs_host(hit: CacheHit) -> bool:
        """Whether some of the hit's blocks are on the host tier (its admission loads them)."""
        return _holds_host_blocks(hit.group_blocks, hit.cow_sources)

    def cacheable_tokens(self, num_tokens: int) -> int:
        """The structural maximum hit: floor(cap/A)*A; under the legacy drop, one A below what
        an EAGLE group can read (the cap alone, or the hashed length in a hybrid layout)."""
        a = self.layout.alignment_tokens
        best = max(num_tokens - 1, 0) // a * a
        if self.layout.speculative.drops_target_tail:
            if self._hybrid:
                hashed = self.hasher.num_hashable(num_tokens) * self.layout.hash_block_size
                best = min(best, hashed // a * a - a)
            else:
                best -= a
        return max(best, 0)

    def _empty_hit(self, num_tokens: int, resumed: bool) -> CacheHit:
        n = self.layout.num_groups
        sample = None
        # With prefix caching off nothing is queried, so nothing is recorded (as in vLLM).
        if self.enable_metrics and self.enable_caching:
            sample = AdmissionSample(
                num_tokens, self.cacheable_tokens(num_tokens), 0, (0,) * n, None, resumed
            )
        return CacheHit(0, ((),) * n, (None,) * n, True, 0, sample)

    # ----- allocation -------------------------------------------------------------------------

    def allocate_running(
        self,
        req_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        num_computed_tokens: int,
        num_new_tokens: int,
        num_lookahead_tokens: int,
    ) -> Allocation | None:
        """`allocate` for a running request, positional and with the no-change fast path first
        (the per-request call of every scheduling step)."""
        total = num_computed_tokens + num_new_tokens
        to_cache = total if total < num_tokens else num_tokens
        wanted = total + num_lookahead_tokens
        for group in self.groups:
            if not group.settled(req_id, wanted, to_cache, num_computed_tokens):
                return self.allocate(
                    req_id,
                    block_hashes,
                    num_tokens=num_tokens,
                    num_computed_tokens=num_computed_tokens,
                    num_new_tokens=num_new_tokens,
                    num_lookahead_tokens=num_lookahead_tokens,
                )
        return self._no_change

    def allocate(
        self,
        req_id: str,
        block_hashes: Sequence[BlockHash],
        *,
        num_tokens: int,
        num_computed_tokens: int,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        hit: CacheHit | None = None,
        num_prompt_tokens: int | None = None,
        full_sequence_must_fit: bool = False,
        received: bool = False,
    ) -> Allocation | None:
        """Make room for `num_new_tokens` (plus lookahead slots) and register full blocks.

        A new admission passes its `hit` (from `find_hit`, just before) and `num_prompt_tokens`;
        `num_computed_tokens` excludes the hit. `received`: the chunk starts with tokens another
        engine computed (a P/D handoff); state groups keep the checkpoint the sender made.
        Returns None, with nothing taken, when the blocks do not fit or the hit is not ready;
        blocks the request no longer needs (outside a window, old states) may still have been
        released. On success the hit's metrics sample is committed, once per admission."""
        if (
            hit is None
            and not full_sequence_must_fit
            and self._settled(
                req_id, num_tokens, num_computed_tokens, num_new_tokens, num_lookahead_tokens
            )
        ):
            return self._no_change
        if hit is not None and not hit.ready:
            return None
        hit_tokens = hit.num_tokens if hit is not None else 0
        total_computed = num_computed_tokens + hit_tokens
        hit_blocks = hit.group_blocks if hit is not None else ((),) * len(self.groups)
        cows = hit.cow_sources if hit is not None else (None,) * len(self.groups)
        keep = self._keep_for(req_id, num_prompt_tokens or num_tokens, hit, received=received)
        if full_sequence_must_fit:
            whole = SlotRequest(num_tokens, total_computed, num_tokens, num_tokens, keep, True)
            if not self.pool.has_room(self._blocks_needed(req_id, whole, hit_blocks, cows)):
                return None
        for group in self.groups:
            group.remove_skipped(req_id, total_computed)
        chunk_end = total_computed + num_new_tokens
        wanted = chunk_end + num_lookahead_tokens
        slots = SlotRequest(wanted, total_computed, chunk_end, num_tokens, keep, received=received)
        if not self.pool.has_room(self._blocks_needed(req_id, slots, hit_blocks, cows)):
            return None
        copies: tuple[BlockCopy, ...] = ()
        if hit is not None:
            self._begin_request(req_id, hit, num_prompt_tokens, keep)
            copies = self._hold_hit(req_id, hit)
        elif req_id not in self._requests:
            self._begin_request(req_id, self._empty_hit(num_tokens, False), num_prompt_tokens, keep)
        new_ids = tuple(tuple(b.block_id for b in g.allocate(req_id, slots)) for g in self.groups)
        if self.enable_caching:
            self._register(req_id, block_hashes, total_computed, num_new_tokens, num_tokens)
        if hit is not None:
            self._commit_admission(req_id, hit)
        return Allocation(new_ids, copies)

    def _commit_admission(self, req_id: str, hit: CacheHit) -> None:
        """Record an admission's hit once (what a prefetch loaded for it counts as the host's)
        and drop the prefetch's hold: the request holds the blocks now."""
        if hit.sample is not None:
            sample = hit.sample
            prefetched = self._prefetched_tokens.pop(req_id, 0)
            if prefetched and not sample.resumed:
                sample = replace(sample, host_hit_tokens=min(prefetched, sample.hit_tokens))
            self.metrics.commit(sample)
        self.release_prefetch(req_id)

    def _settled(
        self,
        req_id: str,
        num_tokens: int,
        num_computed_tokens: int,
        num_new_tokens: int,
        num_lookahead_tokens: int,
    ) -> bool:
        """Every group already holds the blocks of this running request's next chunk and has
        registered what it can: allocating would change nothing."""
        total = num_computed_tokens + num_new_tokens
        to_cache = total if total < num_tokens else num_tokens
        wanted = total + num_lookahead_tokens
        for group in self.groups:
            if not group.settled(req_id, wanted, to_cache, num_computed_tokens):
                return False
        return True

    def _keep_for(
        self, req_id: str, num_prompt_tokens: int, hit: CacheHit | None, *, received: bool
    ) -> KeepMask | None:
        """The retention mask an allocation places checkpoints by: the request's own once it is
        admitted; for an admission built here when a group checkpoints or the chunk was
        received (its checkpoint is kept); else None (built later by `_begin_request`)."""
        state = self._requests.get(req_id)
        if state is not None:
            return state.keep
        if self._checkpointing or received:
            return self._keep_mask(self._boundaries(num_prompt_tokens, hit))
        return None

    def _hold_hit(self, req_id: str, hit: CacheHit) -> tuple[BlockCopy, ...]:
        """Take every group's hit blocks for an admission, then the copy-on-write targets of
        partial hit blocks: the copies to run before the step."""
        # Hold every group's hit first: a new block must never be another group's hit.
        promoted: dict[int, Block] = {}
        host = self.host
        if host is not None:
            for part in (*hit.group_blocks, hit.cow_sources):
                for block in part:
                    if isinstance(block, HostBlock):
                        host.claim(block)
        for gid, group in enumerate(self.groups):
            group.add_hit(req_id, hit.group_blocks[gid], hit.cow_sources[gid])
        if host is not None:
            promoted = self._promote(req_id, host)
        copies = []
        for gid, group in enumerate(self.groups):
            cow_src = hit.cow_sources[gid]
            if cow_src is not None:
                cow_src = promoted.get(id(cow_src), cow_src)
                cow_dst = group.add_copy_target(req_id)
                offset = hit.num_tokens % group.block_size
                copies.append(BlockCopy(gid, cow_src.block_id, cow_dst.block_id, offset))
        return tuple(copies)

    def _promote(self, req_id: str, host: HostTier) -> dict[int, Block]:
        """Give every host block the admission holds (in its tables, or held as a copy-on-write
        source) a device block carrying its key, and queue its load. Returns the device block
        of each, by the host block's id()."""
        promoted: dict[int, Block] = {}
        for group in self.groups:
            table = group.tables[req_id]
            for index, block in enumerate(table):
                if isinstance(block, HostBlock):
                    table[index] = self._load(host, group, block, (req_id, index))
                    promoted[id(block)] = table[index]
            for index, block in enumerate(group.cow_holds):
                if isinstance(block, HostBlock):
                    group.cow_holds[index] = self._load(host, group, block, None)
                    promoted[id(block)] = group.cow_holds[index]
        return promoted

    def _load(
        self,
        host: HostTier,
        group: GroupManager,
        block: HostBlock,
        where: tuple[str, int] | None,
        *,
        prefetch: bool = False,
    ) -> Block:
        """A device block for `block`'s content: registered under its key, loaded before the
        step. The caller checked that the pool has room (a host block counts as one)."""
        key = block.key
        assert key is not None
        device = self.pool.allocate(1)[0]
        self.pool.register(device, key, group.ctx.group_id)
        host.load(block, device, prefetch=prefetch)
        events = self.pool.events
        if events is not None:
            if where is None:
                events.promoted(key, group.ctx.group_id)
            else:
                req_id, index = where
                unit, suffix = group.block_size, len(group.key_suffix)
                start = index * unit
                events.stored(group.ctx.group_id, key[:-suffix], None, req_id, start, start + unit)
        return device

    def take_host_transfers(self) -> tuple[tuple[HostCopy, ...], tuple[HostCopy, ...]]:
        """The saves and loads the host tier queued since the last call (none without one)."""
        if self.host is None:
            return (), ()
        return self.host.take_transfers()

    def _blocks_needed(
        self,
        req_id: str,
        slots: SlotRequest,
        hit_blocks: Sequence[Sequence[Block]],
        cows: Sequence[Block | None],
    ) -> int:
        return sum(
            g.num_blocks_needed(req_id, slots, hit_blocks[gid], cows[gid])
            for gid, g in enumerate(self.groups)
        )

    def _begin_request(
        self,
        req_id: str,
        hit: CacheHit,
        num_prompt_tokens: int | None,
        keep: KeepMask | None = None,
    ) -> None:
        """Record a new admission; `keep` is its retention mask when `allocate` built it."""
        if num_prompt_tokens is None:
            raise ValueError(f"request {req_id!r}: a new admission must give num_prompt_tokens")
        boundaries = self._boundaries(num_prompt_tokens, hit)
        if keep is None:
            keep = self._keep_mask(boundaries)
        self._requests[req_id] = _RequestState(num_prompt_tokens, boundaries, keep)

    def _keep_mask(self, boundaries: Sequence[int]) -> KeepMask:
        layout = self.layout
        retention = layout.retention
        state: set[int] = set()
        window: set[int] = set()
        dropped_window: set[int] = set()
        for index, boundary in enumerate(boundaries):
            if index > 0 and retention.kind in (
                RetentionKind.BOUNDARY,
                RetentionKind.BOUNDARY_ONLY,
                RetentionKind.INTERVAL,
            ):
                # vLLM keeps a shared-prefix junction as found (it is already past the drop).
                state.add(boundary)
                window.add(boundary)
                if layout.speculative.drops_target_tail and (
                    retention.kind is not RetentionKind.BOUNDARY_ONLY
                ):
                    # vLLM 0.33: a tail-dropping window group also keeps the landing one block
                    # of its own below the junction (a hit, on the A grid), floored to A: a
                    # sibling diverging right after the junction has no block past it to drop.
                    a = layout.alignment_tokens
                    dropped_window.add(max(boundary // a * a - a, 0))
                continue
            landing = retention.landing_positions(
                boundary,
                alignment=layout.alignment_tokens,
                drops_target_tail=layout.speculative.drops_target_tail,
                sharded_units=layout.sharded_units,
            )
            state.update(landing.state)
            window.update(landing.window)
        # A landing the target reaches but some group cannot serve (its block is coarser than
        # A) falls to that group's grid: keep those lower positions in every group too.
        frontier = set(window)
        while frontier:
            projected = {p // g * g for p in frontier for g in self._serving_grids} - window
            projected.discard(0)
            window |= projected
            state |= projected
            frontier = projected
        interval = retention.interval_tokens if retention.kind is RetentionKind.INTERVAL else 0
        return KeepMask(
            dense=retention.is_dense,
            interval=interval,
            state_positions=tuple(sorted(state)),
            window_positions=tuple(sorted(window)),
            dropped_window_positions=tuple(sorted(dropped_window - window)),
        )

    def _register(
        self,
        req_id: str,
        block_hashes: Sequence[BlockHash],
        total_computed: int,
        num_new_tokens: int,
        num_tokens: int,
    ) -> None:
        # Never past num_tokens: draft tokens are unverified.
        num_to_cache = min(total_computed + num_new_tokens, num_tokens)
        chunk_end = total_computed + num_new_tokens
        keep = self._requests[req_id].keep
        page = self._scheduler_block
        clamp = self._hybrid and not self.layout.partial_hash_hits
        for group in self.groups:
            hashes = derived_hashes(block_hashes, group.ctx.hash_ratio)
            limit = num_to_cache
            if clamp:
                # vLLM's get_num_cacheable_tokens: whole scheduler blocks (lcm of the groups'
                # blocks), one more block of an EAGLE group on the legacy path once at least
                # one scheduler block is cacheable (a shorter prefix registers nothing).
                limit = num_to_cache // page * page
                if group.ctx.drops_tail and limit > 0:
                    limit = min(limit + group.block_size, num_to_cache)
            start = group.num_processed.get(req_id, 0)
            group.register(req_id, hashes, limit, chunk_end=chunk_end, keep=keep, base=block_hashes)
            if self.host is not None and self.host.write_through:
                self._write_through(req_id, group, start)

    def _write_through(self, req_id: str, group: GroupManager, start: int) -> None:
        """Save to the host the prompt blocks `group` registered for `req_id` from table index
        `start` on (vLLM's offloading stores prompts only, by default), once computed."""
        host, table = self.host, group.tables.get(req_id, ())
        assert host is not None
        prompt_blocks = self._requests[req_id].num_prompt_tokens // group.block_size
        end = min(group.num_processed.get(req_id, 0), len(table), prompt_blocks)
        for block in table[start:end]:
            if block.key is not None and block.block_id > 0:
                host.save(block, computed=False)

    def cache_computed(
        self, req_id: str, block_hashes: Sequence[BlockHash], num_computed: int, num_tokens: int
    ) -> None:
        """Register the full blocks of the first `num_computed` tokens (a finishing request)."""
        if self.enable_caching and req_id in self._requests:
            self._register(req_id, block_hashes, num_computed, 0, num_tokens)

    def free(self, req_id: str) -> None:
        """Release every block of a finished or preempted request (deepest first per group),
        and what a prefetch holds for it."""
        for group in self.groups:
            group.free(req_id)
        self._requests.pop(req_id, None)
        self.release_prefetch(req_id)
        self._prefetched_tokens.pop(req_id, None)

    # ----- host tier prefetch -----------------------------------------------------------------

    def prefetch(self, req_id: str, hit: CacheHit, num_tokens: int) -> bool:
        """Start loading the host blocks of a waiting request's hit (vLLM's asynchronous KV
        load): each gets a device block carrying its key, whose load runs beside later steps;
        the hit's device blocks are held too, so the request finds all of it once the loads are
        done (`find_hit` says the hit is not ready until then). False, changing nothing, when
        the hit has no host block, a prefetch for the request runs already, or the pool lacks
        room for the loads and the rest of the request's `num_tokens` (a prefetch that left no
        room for the prompt past its hit would hold the pool while its request never starts)."""
        host = self.host
        if host is None or req_id in self._prefetch:
            return False
        parts = [*hit.group_blocks, tuple(c for c in hit.cow_sources if c is not None)]
        blocks = list(dict.fromkeys(b for part in parts for b in part if b.block_id != 0))
        if not any(isinstance(b, HostBlock) for b in blocks):
            return False
        rest = self.growth_blocks(hit.num_tokens, max(num_tokens - hit.num_tokens, 0))
        rest += 2 * (len(self.groups) - len(self._full_groups))  # a state and its scratch each
        if not self.pool.has_room(sum(1 for b in blocks if b.ref_cnt == 0) + rest):
            return False
        for block in blocks:
            if isinstance(block, HostBlock):
                host.claim(block)
        self.pool.touch(blocks)
        held: list[Block] = []
        host.prefetching = True
        try:
            for block in blocks:
                if isinstance(block, HostBlock):
                    group = self.groups[block.group_id]
                    block = self._load(host, group, block, None, prefetch=True)
                held.append(block)
        finally:
            host.prefetching = False
        self._prefetch[req_id] = held
        if hit.sample is not None:
            self._prefetched_tokens[req_id] = hit.sample.host_hit_tokens
        return True

    def is_prefetching(self, req_id: str) -> bool:
        return req_id in self._prefetch

    def release_prefetch(self, req_id: str) -> None:
        """Drop what a prefetch holds for `req_id` (its admission holds the blocks now, or it
        left the head of the queue). Loaded blocks stay cached; a load still queued is taken
        back (its key stays on the host) and its block leaves the prefix cache."""
        held = self._prefetch.pop(req_id, None)
        if not held:
            return
        host = self.host
        assert host is not None
        loading = [b for b in held if host.is_loading(b.block_id)]
        if loading:
            host.cancel_loads({b.block_id for b in loading})
        self.pool.free(held[::-1])
        for block in loading:
            self.pool.uncache(block)

    def release_prefetches(self, *, keep: str | None = None) -> int:
        """Release every prefetch but `keep`'s (the head waiter's). Returns how many."""
        others = [r for r in self._prefetch if r != keep]
        for req_id in others:
            self.release_prefetch(req_id)
            self._prefetched_tokens.pop(req_id, None)
        return len(others)

    def drop_failed_loads(self, block_ids: Iterable[int]) -> None:
        """A step whose plan carried loads into these blocks failed: every prefetch is let go
        (what it loaded in that step, or queued, leaves the prefix cache), and the host keys
        whose saves would read these blocks are dropped."""
        failed = set(block_ids)
        self.release_prefetches()
        self.uncache_free_blocks(failed)
        if self.host is not None:
            self.host.forget_blocks(failed)

    def _loading(
        self, group_blocks: Sequence[Sequence[Block]], cows: Sequence[Block | None]
    ) -> bool:
        host = self.host
        assert host is not None
        return any(host.is_loading(b.block_id) for blocks in group_blocks for b in blocks) or any(
            c is not None and host.is_loading(c.block_id) for c in cows
        )

    # ----- tool-call pinning -------------------------------------------------------------------

    def pin(
        self,
        session_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        *,
        deadline: float,
        max_pinned_blocks: int,
        req_id: str | None = None,
        token_ids: Sequence[int] = (),
    ) -> int:
        """Hold out of eviction, until `deadline`, the blocks that the next lookup of a request
        extending these `num_tokens` tokens would hit: every group's blocks of the reconciled
        hit, the state at the boundary that lookup lands on included (for a hybrid layout the
        state the retention kept). Call before freeing the finished request. A session holds
        one pin (its latest turn's). Refused, pinning nothing, if the distinct pinned blocks
        would exceed `max_pinned_blocks`. Returns the number of blocks pinned.

        With the finishing request's `req_id` and `token_ids` (exact tails), the pin also holds
        the turn's exact end: its whole full-attention table, its partial last block and its
        running state, so that `session_hit` can resume the session's next turn at
        `num_tokens` itself rather than at the last retained boundary."""
        self.unpin(session_id, returned=False)  # this turn's end supersedes an earlier one
        if not self.enable_caching or self.pool.growable:
            return 0
        hit = self.find_hit(block_hashes, num_tokens + 1)  # the next turn adds >= 1 token
        tail = None
        if req_id is not None:
            tail = exact_tail(
                self.groups,
                self._full_groups,
                self.pool.null_block,
                hash_block=self.layout.hash_block_size,
                req_id=req_id,
                block_hashes=block_hashes,
                token_ids=token_ids,
                num_tokens=num_tokens,
            )
        parts = [(hit.group_blocks, hit.cow_sources)]
        if tail is not None:
            parts.append((tail.group_blocks, tail.cow_sources))
        null = self.pool.null_block
        seen: set[int] = set()
        blocks: list[Block] = []
        for part_blocks, part_cows in parts:
            for group_blocks, cow in zip(part_blocks, part_cows, strict=True):
                for block in (*group_blocks, *((cow,) if cow is not None else ())):
                    if block is null or block.block_id <= 0 or block.block_id in seen:
                        continue
                    if self.host is not None and self.host.is_loading(block.block_id):
                        continue  # a prefetch's block is not pinned before its load ran
                    seen.add(block.block_id)
                    blocks.append(block)
        return self.pins.hold(
            session_id,
            blocks,
            deadline=deadline,
            tail=tail,
            max_pinned_blocks=max_pinned_blocks,
        )

    def exact_tail_obstacle(self) -> str | None:
        """Why this layout cannot hold exact tails (None: it can): every group must be full
        attention / MLA or an align-mode state group (a window's or a chunk's blocks are not
        kept). Does not mutate."""
        for gid, group in enumerate(self.groups):
            if gid in self._full_groups or (isinstance(group, MambaManager) and group.align):
                continue
            return (
                f"group {gid} is {group.kind.value}: exact tails need full-attention and "
                "align-mode state groups only"
            )
        return None

    def session_hit(
        self,
        session_id: str,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        *,
        resumed: bool = False,
    ) -> CacheHit | None:
        """The hit at the exact end of the session's last turn, if its pin holds one (or the
        host tier kept it after the pin was released) and this prompt (its hashes and tokens)
        starts with that turn's tokens; else None. Like `find_hit`, it never mutates the pool:
        allocate it at once."""
        num_tokens = len(token_ids)
        found = self._session_end(session_id, block_hashes, token_ids)
        if found is None:
            return None
        end, group_blocks, cows = found
        ready = self._ready(group_blocks, cows)
        sample = None
        if self.enable_metrics:
            host_tokens = 0
            if _holds_host_blocks(group_blocks, cows):
                host_tokens = end - self._device_hit(block_hashes, num_tokens)
            sample = AdmissionSample(
                queried_tokens=num_tokens,
                cacheable_tokens=max(self.cacheable_tokens(num_tokens), end),
                hit_tokens=end,
                group_offered_tokens=(end,) * self.layout.num_groups,
                limiting_group=None,
                resumed=resumed,
                host_hit_tokens=host_tokens,
            )
        return CacheHit(end, group_blocks, cows, ready, 0, sample, from_tail=True)

    def _session_end(
        self, session_id: str, block_hashes: Sequence[BlockHash], token_ids: Sequence[int]
    ) -> tuple[int, tuple[tuple[Block, ...], ...], tuple[Block | None, ...]] | None:
        """The session's pinned or host-kept turn end this prompt starts with: its length,
        every group's blocks and copy-on-write sources."""
        tail, hash_block = self.pins.tail(session_id), self.layout.hash_block_size
        if tail is None:
            if self.host_tails is None:
                return None
            return self.host_tails.find(session_id, block_hashes, token_ids, hash_block)
        if tail.num_tokens > len(token_ids) - 1 or not tail.serves(
            block_hashes, token_ids, hash_block
        ):
            return None
        return tail.num_tokens, tail.group_blocks, tail.cow_sources

    # The pin table's operations, as the scheduler calls them (see PinTable).

    def unpin(self, session_id: str, *, returned: bool = True) -> int:
        """Release a session's pin, and forget the turn end the host tier kept for it: its next
        turn is back (`returned`), or a newer turn replaces them. Returns the blocks it held."""
        if self.host_tails is not None:
            self.host_tails.forget(session_id)
        return self.pins.unpin(session_id) if returned else self.pins.release(session_id)

    def count_tail_hit(self, session_id: str) -> None:
        """An admission resumed at the session's exact end (call before `unpin`): pinned, or
        kept through the host tier."""
        stats = self.pins.stats
        stats.tail_hits += 1
        kept = self.host_tails is not None and self.host_tails.holds(session_id)
        if kept and self.pins.tail(session_id) is None:
            stats.host_tail_hits += 1

    def expire_pins(self, now: float) -> int:
        """Release every pin whose TTL has run out by `now`. Returns how many."""
        return self.pins.expire(now)

    def release_pin_for_room(self, *, keep: str | None = None) -> bool:
        """Memory pressure: release the pin that expires first (never `keep`'s)."""
        return self.pins.release_soonest(keep=keep)

    def claim_pin(self, session_id: str) -> bool:
        """The session's next turn arrived: its pin holds until that turn is admitted."""
        return self.pins.claim(session_id)

    def next_pin_deadline(self) -> float | None:
        """The soonest TTL of any pin (claimed pins have none); None when no pin expires."""
        return self.pins.next_deadline()

    @property
    def pin_stats(self) -> PinStats:
        return self.pins.stats

    def growth_blocks(self, num_tokens: int, num_new_tokens: int) -> int:
        """Blocks the full-attention groups need to grow a sequence of `num_tokens` tokens by
        `num_new_tokens` (window and state groups hold a bounded number: not counted)."""
        total = 0
        for gid in self._full_groups:
            size = self.groups[gid].block_size
            total += -(-(num_tokens + num_new_tokens) // size) - -(-num_tokens // size)
        return total

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks held by pins."""
        return self.pins.num_pinned_blocks

    @property
    def num_pins(self) -> int:
        return self.pins.num_pins

    def uncache_free_blocks(self, block_ids: Iterable[int]) -> int:
        """Take the free blocks among `block_ids` out of the prefix cache, so that no later
        request hits their content: a step that failed may have left it partly written.
        Blocks a request still holds are left alone. Returns how many were taken out."""
        blocks = self.pool.blocks
        return sum(self.pool.uncache(blocks[i]) for i in set(block_ids) if 0 < i < len(blocks))

    def forget_host_slots(self, slots: Iterable[int]) -> int:
        """Drop the host keys in these slots: a failed step's saves may not have run. Returns
        how many were dropped."""
        return self.host.forget(set(slots)) if self.host is not None else 0

    def new_step(self) -> None:
        """Call at the start of every schedule(): states registered before are now final, and
        the prefetches the last plan carried are complete."""
        for group in self.groups:
            group.new_step()
        if self.host is not None:
            self.host.new_step()
            self._save_ahead(self.host)

    def _save_ahead(self, host: HostTier) -> None:
        """Copy to the host, beside the forward, the cached free blocks next in line for
        eviction (up to a step's worth of loads), so that evicting them later costs no copy
        before a forward. Not under write-through (every block is there already)."""
        budget = host.loads_per_step
        if not budget or host.write_through:
            return
        for looked, block in enumerate(self.pool.free_queue):
            if budget <= 0 or looked >= 4 * host.loads_per_step:
                break
            if block.key is not None and block.key not in host:
                host.save(block, ahead=True)
                budget -= 1

    # ----- queries ----------------------------------------------------------------------------

    def checkpoint_positions(self, req_id: str) -> tuple[int, ...]:
        """Positions where an align-mode state group wants a prefill chunk to end."""
        state = self._requests.get(req_id)
        if state is None or not self._state_grids:
            return ()
        return self._on_state_grid(state.keep.state_positions)

    def _on_state_grid(self, positions: Sequence[int]) -> tuple[int, ...]:
        return tuple(p for p in positions if any(p % g == 0 for g in self._state_grids))

    def planned_checkpoints(self, num_prompt_tokens: int, hit: CacheHit | None) -> tuple[int, ...]:
        """`checkpoint_positions` of a request before it is admitted with `hit`."""
        if not self._state_grids:
            return ()
        keep = self._keep_mask(self._boundaries(num_prompt_tokens, hit))
        return self._on_state_grid(keep.state_positions)

    @staticmethod
    def _boundaries(num_prompt_tokens: int, hit: CacheHit | None) -> tuple[int, ...]:
        """Reachable boundaries: the replay boundary, and a junction found at admission."""
        if hit is not None and hit.junction:
            return (num_prompt_tokens - 1, hit.junction)
        return (num_prompt_tokens - 1,)

    def block_ids(self, req_id: str) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple([b.block_id for b in g.tables.get(req_id, ())]) for g in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usable_blocks(self) -> int:
        return self.pool.usable_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def registered_blocks(self) -> list[int]:
        return [g.num_registered for g in self.groups]

    def evicted_blocks(self) -> list[int]:
        return [self.pool.evictions_by_group.get(g, 0) for g in range(len(self.groups))]

    def metrics_snapshot(self) -> dict[str, object]:
        snapshot = self.metrics.snapshot(
            registered=self.registered_blocks(), evicted=self.evicted_blocks()
        )
        if self.host is not None:
            snapshot["host"] = {
                "slots": self.host.num_slots,
                "used_slots": self.host.num_used,
                "hit_tokens": self.metrics.host_hit_tokens,
                **self.host.stats.as_dict(),
            }
        return snapshot

    def check_invariants(self) -> None:
        """Raise CacheInvariantError if any invariant of SPEC.md section 8 items 1-4 is broken."""
        self.pool.check_invariants()
        if self.host is not None:
            self.host.check_invariants()
        expected: dict[int, int] = {}
        null = self.pool.null_block
        for group in self.groups:
            for req_id, table in group.tables.items():
                if req_id not in self._requests:
                    raise CacheInvariantError(
                        f"group {group.ctx.group_id} holds unknown {req_id!r}"
                    )
                for block in table:
                    if isinstance(block, HostBlock):
                        raise CacheInvariantError(f"{req_id!r} holds {block} past its admission")
                    if block is not null:
                        expected[block.block_id] = expected.get(block.block_id, 0) + 1
            for block in group.held_outside_tables():
                expected[block.block_id] = expected.get(block.block_id, 0) + 1
        for block in self.pins.held_blocks():
            expected[block.block_id] = expected.get(block.block_id, 0) + 1
        for held in self._prefetch.values():
            for block in held:
                expected[block.block_id] = expected.get(block.block_id, 0) + 1
        for block in self.pool.blocks[1:]:
            if block.ref_cnt != expected.get(block.block_id, 0):
                raise CacheInvariantError(
                    f"{block}: ref count {block.ref_cnt} but {expected.get(block.block_id, 0)} "
                    "table entries point at it"
                )
            if block.key is not None and block.group_id < 0:
                raise CacheInvariantError(f"{block} is hashed without a group")


def _ids(blocks: Iterable[Block]) -> set[int]:
    return {b.block_id for b in blocks}


def _holds_host_blocks(
    group_blocks: Sequence[Sequence[Block]], cows: Sequence[Block | None]
) -> bool:
    return any(b.block_id < 0 for blocks in group_blocks for b in blocks) or any(
        c is not None and c.block_id < 0 for c in cows
    )


def _admission_cap(spec: object, max_in_flight_tokens: int) -> int:
    """vLLM's SlidingWindowSpec.max_admission_blocks_per_request: a sliding-window request
    never holds more than its window plus the tokens in flight, so admission counts no more."""
    if not isinstance(spec, SlidingWindowSpec) or max_in_flight_tokens <= 0:
        return 0
    return -(-(spec.window - 1 + max_in_flight_tokens) // spec.block_size) + 1


_SERVING_KINDS = (GroupKind.MAMBA, GroupKind.SWA, GroupKind.DRAFT)


def _build_groups(layout: CacheLayout, pool: BlockPool) -> list[GroupManager]:
    """One manager per group of the layout, over the shared pool."""
    h, a = layout.hash_block_size, layout.alignment_tokens
    return [
        make_manager(
            spec,
            GroupContext(
                gid,
                unit,
                unit // h,
                a,
                layout.drops_tail(gid),
                layout.speculative.drops_target_tail,
                _admission_cap(spec, layout.max_in_flight_tokens),
                layout.partial_hash_hits and a < unit,
                math.lcm(*(g.block_size for g in layout.groups)),
            ),
            pool,
        )
        for gid, (spec, unit) in enumerate(zip(layout.groups, layout.units, strict=True))
    ]


def _grids(layout: CacheLayout, block_sizes: Iterable[int]) -> list[int]:
    """The sorted distinct grids lcm(A, block size) of these block sizes."""
    return sorted({math.lcm(layout.alignment_tokens, b) for b in block_sizes})
