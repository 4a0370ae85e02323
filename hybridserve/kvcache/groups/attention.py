"""Attention-like groups: full attention / MLA, sliding window (and draft KV), chunked local."""

from __future__ import annotations

from collections.abc import Sequence

from hybridserve.kvcache.block_pool import Block, BlockPool
from hybridserve.kvcache.groups.base import (
    GroupContext,
    GroupLookup,
    GroupManager,
    KeepMask,
    cdiv,
)
from hybridserve.kvcache.hashing import BlockHash
from hybridserve.kvcache.spec import (
    ChunkedLocalSpec,
    DraftSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)


class FullAttentionManager(GroupManager):
    """Left-to-right and downward-closed: a hit at L implies a hit at every aligned L' < L."""

    def __init__(self, spec: FullAttentionSpec, ctx: GroupContext, pool: BlockPool) -> None:
        super().__init__(spec, ctx, pool)
        self.kind = spec.kind

    def settled(self, req_id: str, num_slots: int, num_to_cache: int, computed: int) -> bool:
        table = self.tables.get(req_id)
        return (
            table is not None
            and len(table) * self.block_size >= num_slots
            and num_to_cache // self.block_size <= self.num_processed[req_id]
        )

    def remove_skipped(self, req_id: str, num_computed_tokens: int) -> None:
        return None  # full attention needs every block

    def lookup(
        self, hashes: Sequence[BlockHash], cap: int, *, base: Sequence[BlockHash] = ()
    ) -> GroupLookup:
        found: list[Block] = []
        get, suffix = self.pool.get_cached, self.key_suffix
        for index in range(min(cap // self.block_size, len(hashes))):
            block = get(hashes[index] + suffix)
            if block is None:
                break
            found.append(block)
        lookup = _FullLookup(found, self.block_size, self.ctx.alignment)
        if self.ctx.partial_hits and base:
            self._find_partial(lookup, base, cap)
        return lookup

    def _find_partial(self, lookup: _FullLookup, base: Sequence[BlockHash], cap: int) -> None:
        """The longest partial tail registered inside the block after the full-block match."""
        a, unit = self.ctx.alignment, self.block_size
        h = unit // self.ctx.hash_ratio
        position = min(cap, lookup.matched + unit - a) // a * a
        while position > lookup.matched:
            if position // h <= len(base):
                block = self.pool.get_cached(base[position // h - 1] + self.key_suffix)
                if block is not None:
                    lookup.partial = (position, block)
                    return
            position -= a

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
        table = self.tables.get(req_id)
        if self.ctx.partial_hits and table:
            # A partial tail superseded by its full block gives its registration up.
            start = self.num_processed[req_id]
            end = min(num_tokens_to_cache // self.block_size, len(table), len(hashes))
            for index in range(start, end):
                if table[index].key is not None:
                    self.pool.unregister(table[index])
        count = super().register(
            req_id, hashes, num_tokens_to_cache, chunk_end=chunk_end, keep=keep, base=base
        )
        if self.ctx.partial_hits and table and base:
            count += self._register_partial(req_id, table, num_tokens_to_cache, keep, base)
        return count

    def _register_partial(
        self,
        req_id: str,
        table: list[Block],
        num_tokens_to_cache: int,
        keep: KeepMask,
        base: Sequence[BlockHash],
    ) -> int:
        """Register the block holding a partial tail (a landing inside a block) under the hash
        at that position; the owner keeps appending to it, a reuser copies it."""
        unit = self.block_size
        h = unit // self.ctx.hash_ratio
        count = 0
        for position in keep.state_positions:
            index = position // unit
            if (
                position % unit == 0
                or position > num_tokens_to_cache
                or index >= len(table)
                or position // h > len(base)
                or table[index].key is not None
                or (index + 1) * unit <= num_tokens_to_cache
            ):
                continue
            key = base[position // h - 1] + self.key_suffix
            if self.pool.register(table[index], key, self.ctx.group_id):
                count += 1
                self._partial_stored(req_id, position, base)
        self.num_registered += count
        return count


class _FullLookup(GroupLookup):
    """The scan runs once; every later candidate is answered by truncation."""

    __slots__ = ("alignment", "found", "matched", "partial", "unit")

    def __init__(self, found: list[Block], unit: int, alignment: int) -> None:
        self.found = found
        self.unit = unit
        self.alignment = alignment
        self.matched = len(found) * unit
        self.partial: tuple[int, Block] | None = None  # a partial tail after the match

    def serve(self, limit: int, drop: bool) -> int:
        if self.partial is not None and limit >= self.partial[0]:
            length = self.partial[0]
        else:
            length = min(limit, self.matched) // self.alignment * self.alignment
        if drop:
            length = max(length - self.alignment, 0)
        return length

    def blocks(self, length: int) -> tuple[list[Block], Block | None]:
        num_full = length // self.unit
        if length % self.unit == 0:
            return self.found[:num_full], None
        if num_full < len(self.found):
            return self.found[:num_full], self.found[num_full]
        assert self.partial is not None and length <= self.partial[0]
        return self.found[:num_full], self.partial[1]


class SlidingWindowManager(GroupManager):
    """A resume at L needs the cached KV of [L - lookback, L): a contiguous run ending at L.

    Used for target sliding-window groups and for a drafter's own KV (DraftSpec), which also
    keeps `extra_tokens` before its window and never drops the target tail.
    """

    spec: SlidingWindowSpec | DraftSpec

    def __init__(
        self, spec: SlidingWindowSpec | DraftSpec, ctx: GroupContext, pool: BlockPool
    ) -> None:
        super().__init__(spec, ctx, pool)
        self.kind = spec.kind
        self.lookback = spec.lookback_tokens
        # Under the EAGLE drop the group drops one block of its own (vLLM, whose window finder
        # needs A on its block grid); with A finer than the block it drops one A.
        on_grid = ctx.alignment % self.block_size == 0
        self.drop_unit = 0
        if ctx.drops_tail:
            self.drop_unit = self.block_size if on_grid else ctx.alignment

    def lookup(
        self, hashes: Sequence[BlockHash], cap: int, *, base: Sequence[BlockHash] = ()
    ) -> GroupLookup:
        return _WindowLookup(self, hashes)

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(num_computed_tokens - self.lookback, 0)

    def skipped_tokens_for_new(self, req_id: str, hit: Sequence[Block]) -> int:
        # Leading null entries of a hit are positions the request never holds.
        null = self.pool.null_block
        return sum(1 for b in hit if b is null)

    @property
    def eagle_margin(self) -> int:
        # vLLM's hybrid coordinator asks a dropping window group one block of its own past the
        # candidate (the block it matches and drops), not one alignment unit.
        return self.drop_unit or self.ctx.alignment

    def _should_register(self, req_id: str, index: int, chunk_end: int, keep: KeepMask) -> bool:
        # A tail-dropping target group needs what it drops after a landing cached (the block
        # its lookup matches and drops): vLLM's reachable_block_mask under use_eagle.
        lookahead = self.drop_unit
        start = index * self.block_size
        if keep.dense:
            return self._reachable_in_segment(index)
        if keep.interval and self._covers_segment(keep.interval):
            return True  # every block ends some interval segment's tail
        return keep.keeps_range(
            start, start + self.block_size, self.lookback, lookahead, drops=lookahead > 0
        )

    def _needed_blocks(self) -> int:
        """Blocks a hit needs ending at its landing: the window, plus the block after the
        landing under the EAGLE drop (vLLM's _contiguous_blocks_for_hit)."""
        return cdiv(self.lookback, self.block_size) + (1 if self.ctx.drops_tail else 0)

    def _covers_segment(self, segment: int) -> bool:
        """Whether the tails kept at segment ends cover whole segments (vLLM caches all)."""
        per_segment = segment // self.block_size if segment > self.block_size else 1
        return self._needed_blocks() >= per_segment

    def _reachable_in_segment(self, index: int) -> bool:
        """Dense retention (vLLM's reachable_block_mask with retention None): a hit lands on the
        scheduler-block grid, so of each segment only the blocks a hit there needs are kept:
        the window's blocks before the segment end, and under the EAGLE drop the block after
        it too (the mask shifts up one block). The others are scratch, unless the window needs
        the whole segment."""
        segment, bs = self.ctx.segment, self.block_size
        if self._covers_segment(segment):
            return True
        per_segment = segment // bs if segment > bs else 1
        shift = 1 if self.drop_unit == bs else 0
        tail = per_segment - self._needed_blocks()  # a segment's first kept block
        return index >= shift and (index - shift) % per_segment >= tail


class _WindowLookup(GroupLookup):
    def __init__(self, manager: SlidingWindowManager, hashes: Sequence[BlockHash]) -> None:
        self.manager = manager
        self.hashes = hashes
        self.unit = manager.block_size
        self.alignment = manager.ctx.alignment
        self._memo: dict[int, Block | None] = {}

    def _block(self, index: int) -> Block | None:
        if index not in self._memo:
            self._memo[index] = self.manager._cached(self.hashes, index)
        return self._memo[index]

    def serve(self, limit: int, drop: bool) -> int:
        if not drop:
            return self._serve_window(limit, 0)
        if self.manager.drop_unit == self.unit:
            return self._serve_dropped(limit)
        return self._serve_window(limit, self.alignment)

    def _missing(self, first: int, last: int) -> int | None:
        """The highest uncached block index in [first, last], None if all are cached."""
        return next((i for i in range(last, first - 1, -1) if self._block(i) is None), None)

    def _serve_window(self, limit: int, margin: int) -> int:
        """The largest L on the A grid, L + margin <= limit, whose window and margin
        [L - lookback, L + margin) are cached (a margin of one A: A finer than the block)."""
        a, unit = self.alignment, self.unit
        end = limit // a * a
        while end > 0:
            first = max(end - margin - self.manager.lookback, 0) // unit
            missing = self._missing(first, cdiv(end, unit) - 1)
            if missing is None:
                return end - margin if end >= margin else 0
            # No candidate whose blocks include `missing` can succeed: jump below it.
            end = min(missing * unit, end - a) // a * a
        return 0

    def _serve_dropped(self, limit: int) -> int:
        """vLLM's window finder under the EAGLE drop: it matches one more block, the block
        after the landing L (L on the A grid, that block inside the limit), then drops it.

        A run too short for the window that starts at block 0 still hits (vLLM's prefix
        fallback): the run is cut to its last block starting on the A grid, rounded down to
        A, and the drop then takes one block off and rounds down to A again.
        """
        a, unit = self.alignment, self.unit
        lookback = self.manager.lookback
        end = (limit // unit - 1) * unit // a * a
        while end >= lookback and end >= 0:
            missing = self._missing((end - lookback) // unit, end // unit)
            if missing is None:
                return end
            end = min((missing - 1) * unit, end - a) // a * a
        # The prefix fallback: the cached run from block 0, within the limit.
        run = 0
        while run < limit // unit and self._block(run) is not None:
            run += 1
        if run == 0:
            return 0
        edge = (run - 1) * unit // a * a  # the run's last block on the A grid starts here
        kept = (edge + unit) // a * a
        return max((kept - unit) // a * a, 0) if kept > 0 else 0

    def blocks(self, length: int) -> tuple[list[Block], Block | None]:
        unit, null = self.unit, self.manager.pool.null_block
        first = max(length - self.manager.lookback, 0) // unit
        num_full = length // unit
        table: list[Block] = [null] * min(first, num_full)
        for index in range(len(table), num_full):
            block = self._block(index)
            assert block is not None
            table.append(block)
        cow = self._block(num_full) if length % unit else None
        return table, cow


class ChunkedLocalManager(GroupManager):
    """Tokens before the current chunk are outside attention: null and counted as computed."""

    spec: ChunkedLocalSpec

    def __init__(self, spec: ChunkedLocalSpec, ctx: GroupContext, pool: BlockPool) -> None:
        super().__init__(spec, ctx, pool)
        self.kind = spec.kind
        self.chunk = spec.chunk

    def lookup(
        self, hashes: Sequence[BlockHash], cap: int, *, base: Sequence[BlockHash] = ()
    ) -> GroupLookup:
        return _ChunkLookup(self, hashes)

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.chunk * self.chunk

    def skipped_tokens_for_new(self, req_id: str, hit: Sequence[Block]) -> int:
        null = self.pool.null_block
        return sum(1 for b in hit if b is null)


class _ChunkLookup(GroupLookup):
    def __init__(self, manager: ChunkedLocalManager, hashes: Sequence[BlockHash]) -> None:
        self.manager = manager
        self.hashes = hashes

    def serve(self, limit: int, drop: bool) -> int:
        unit, chunk = self.manager.block_size, self.manager.chunk
        start = limit // chunk * chunk
        length = start
        while length + unit <= limit and self.manager._cached(self.hashes, length // unit):
            length += unit
        a = self.manager.ctx.alignment
        return length // a * a

    def blocks(self, length: int) -> tuple[list[Block], Block | None]:
        unit, null = self.manager.block_size, self.manager.pool.null_block
        start = length // self.manager.chunk * self.manager.chunk
        table: list[Block] = [null] * (start // unit)
        for index in range(start // unit, length // unit):
            block = self.manager._cached(self.hashes, index)
            assert block is not None
            table.append(block)
        return table, None
