"""Mamba2 / gated-delta-net state groups: a hit needs the one state snapshot taken at L."""

from __future__ import annotations

from collections.abc import Sequence

from hybridserve.kvcache.block_pool import Block, BlockPool
from hybridserve.kvcache.groups.base import (
    GroupContext,
    GroupLookup,
    GroupManager,
    KeepMask,
    SlotRequest,
    _num_evictable,
    cdiv,
)
from hybridserve.kvcache.hashing import BlockHash
from hybridserve.kvcache.spec import MambaCacheMode, MambaSpec


class MambaManager(GroupManager):
    """State checkpoints at block ends.

    `all` mode holds a real block at every block index. `align` mode holds only the running
    state block (the one at the last computed position) plus, for one step, the previous one
    that the kernel reads from; a state exists at a block end only if a scheduled chunk ended
    there. The group never drops a target tail. A state registered in the current step is not
    served to another request until the next step (its hit is reported as not ready).
    """

    spec: MambaSpec

    def __init__(self, spec: MambaSpec, ctx: GroupContext, pool: BlockPool) -> None:
        super().__init__(spec, ctx, pool)
        self.kind = spec.kind
        self.align = spec.mode is MambaCacheMode.ALIGN
        self.keys_this_step: set[bytes] = set()
        self.live: dict[str, list[int]] = {}  # align mode: indices of real blocks, ascending
        self.checkpoints: dict[str, int] = {}  # align mode: this step's prefill checkpoint index

    def lookup(self, hashes: Sequence[BlockHash], cap: int) -> GroupLookup:
        return _StateLookup(self, hashes)

    def new_step(self) -> None:
        super().new_step()
        self.keys_this_step.clear()

    def _on_registered(self, block_hash: BlockHash) -> None:
        self.keys_this_step.add(block_hash + self.key_suffix)

    def is_fresh(self, block: Block) -> bool:
        """True if `block`'s state was registered in the current step."""
        return block.key is not None and block.key in self.keys_this_step

    # ----- allocation -------------------------------------------------------------------------

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        if not self.align:
            return 0
        # Keep only the block holding the state at the last computed position.
        return max(cdiv(num_computed_tokens, self.block_size) - 1, 0) * self.block_size

    def settled(self, req_id: str, num_slots: int, num_to_cache: int, computed: int) -> bool:
        # The per-request, per-step fast path (called for every group): integer arithmetic
        # inline, no generator.
        table = self.tables.get(req_id)
        bs = self.block_size
        if (
            table is None
            or len(table) * bs < num_slots
            or num_to_cache // bs > self.num_processed[req_id]
        ):
            return False
        if not self.align:
            return True
        if self.spec.num_speculative_blocks:
            return False  # the draft-state blocks follow the chunk end: take the full path
        live = self.live.get(req_id)
        if not live or live[0] < (computed - 1 if computed > 1 else 0) // bs:
            return False  # a stale state is to be released
        # Every state and scratch block of the chunk must be live already (the chunk end lies
        # between num_to_cache and num_slots).
        start = num_to_cache if num_to_cache > computed else computed
        first = -(-(start if start > 1 else 1) // bs) - 1
        for i in range(first, -(-num_slots // bs)):  # noqa: SIM110 (a generator costs more)
            if i not in live:
                return False
        return True

    def num_blocks_needed(
        self, req_id: str, slots: SlotRequest, hit: Sequence[Block], cow_src: Block | None
    ) -> int:
        if not self.align:
            return super().num_blocks_needed(req_id, slots, hit, cow_src)
        return len(self._new_indices(req_id, slots, hit)) + _num_evictable(hit, self.pool)

    def _new_indices(self, req_id: str, slots: SlotRequest, hit: Sequence[Block]) -> list[int]:
        """Table indices that need a real block: the state at the chunk end, the draft-token
        scratch states after it (lookahead), and a prefill checkpoint."""
        bs, null = self.block_size, self.pool.null_block
        state = cdiv(slots.chunk_end, bs) - 1
        if self.spec.num_speculative_blocks:
            last = state + self.spec.num_speculative_blocks
        else:
            last = max(cdiv(slots.num_slots, bs) - 1, state)
        live = set(self.live.get(req_id, ()))
        live.update(i for i, b in enumerate(hit) if b is not null)
        indices = [i for i in range(max(state, 0), last + 1) if i not in live]
        if indices:
            checkpoint = self._checkpoint_index(slots)
            if checkpoint is not None and checkpoint not in live:
                indices.insert(0, checkpoint)
        return indices

    def _checkpoint_index(self, slots: SlotRequest) -> int | None:
        """Where the final prefill chunk writes the state at its last block boundary: None when
        that boundary is where the chunk starts (its state exists). A draft-state block already
        at that index is reused."""
        index = self._checkpoint_position(slots)
        if index is None or index < 0 or index <= slots.computed // self.block_size - 1:
            return None
        return index

    def _checkpoint_position(self, slots: SlotRequest) -> int | None:
        """The table index of a chunk's prefill checkpoint: the block ending at the last retained
        position strictly inside a chunk that starts on the grid (vLLM's
        num_prefill_checkpoint_blocks=1 with its reachable mask: any block end under dense
        retention, a landing or interval position otherwise). Under `boundary`
        retention that is the final chunk's replay boundary (one block lower under the EAGLE
        drop)."""
        keep = slots.keep
        if not self.spec.prefill_checkpoint or keep is None:
            return None
        bs, start, a = self.block_size, slots.computed, self.ctx.alignment
        if start % bs:
            return None
        position = (slots.chunk_end - 1) // bs * bs
        while position > start:
            if position % a == 0 and keep.keeps_position(position):
                return position // bs - 1
            position -= bs
        return None

    def add_hit(self, req_id: str, hit: Sequence[Block], cow_src: Block | None) -> None:
        super().add_hit(req_id, hit, cow_src)
        if self.align:
            null = self.pool.null_block
            self.live[req_id] = [i for i, b in enumerate(hit) if b is not null]

    def allocate(self, req_id: str, slots: SlotRequest) -> list[Block]:
        if not self.align:
            return super().allocate(req_id, slots)
        table = self.tables.setdefault(req_id, [])
        self.num_processed.setdefault(req_id, 0)
        live = self.live.setdefault(req_id, [])
        indices = self._new_indices(req_id, slots, ())
        checkpoint = self._checkpoint_index(slots) if indices else None
        if checkpoint is not None:
            self.checkpoints[req_id] = checkpoint
        else:
            self.checkpoints.pop(req_id, None)
        if not indices:
            return []
        if self.spec.num_speculative_blocks:
            self._release_stale_scratch(req_id, slots, indices)
        table.extend([self.pool.null_block] * (max(indices) + 1 - len(table)))
        blocks = self.pool.allocate(len(indices))
        for index, block in zip(indices, blocks, strict=True):
            table[index] = block
            live.append(index)
        live.sort()
        return blocks

    def _release_stale_scratch(self, req_id: str, slots: SlotRequest, new: list[int]) -> None:
        """Draft-state blocks of an earlier step that the state moved past: neither the state
        the chunk starts from, nor one this chunk writes, nor its checkpoint."""
        bs, null = self.block_size, self.pool.null_block
        source = cdiv(slots.computed, bs) - 1
        state = cdiv(slots.chunk_end, bs) - 1
        keep = {source, *range(state, state + self.spec.num_speculative_blocks + 1), *new}
        checkpoint = self._checkpoint_position(slots)
        if checkpoint is not None:
            keep.add(checkpoint)
        table, live = self.tables[req_id], self.live[req_id]
        stale = [i for i in live if i > source and i not in keep and table[i] is not null]
        if stale:
            freed = [table[i] for i in stale]
            for i in stale:
                table[i] = null
            self.pool.free(freed)
            live[:] = [i for i in live if i not in stale]

    def remove_skipped(self, req_id: str, num_computed_tokens: int) -> None:
        """Release states no later step reads, as vLLM does: first the run of real blocks just
        below the computed position (one release), then the previous running state."""
        if not self.align:
            super().remove_skipped(req_id, num_computed_tokens)
            return
        live = self.live.get(req_id)
        if not live:
            return
        table = self.tables[req_id]
        keep_from = cdiv(num_computed_tokens, self.block_size) - 1
        top = min(max(num_computed_tokens - 1, 0) // self.block_size, len(table))
        null = self.pool.null_block
        run = []
        for index in range(top - 1, -1, -1):
            if table[index] is null:
                break
            run.append(index)
        rest = [i for i in live if i < keep_from and i not in run]
        for group in (run, *([i] for i in sorted(rest, reverse=True))):
            if group:
                freed = [table[i] for i in group]
                for i in group:
                    table[i] = null
                self.pool.free(freed)
        self.live[req_id] = [i for i in live if table[i] is not null]

    def free(self, req_id: str) -> None:
        self.live.pop(req_id, None)
        self.checkpoints.pop(req_id, None)
        super().free(req_id)

    def _should_register(self, req_id: str, index: int, chunk_end: int, keep: KeepMask) -> bool:
        # In align mode a state exists only where this step's chunk ends, or at its last block
        # boundary when a prefill checkpoint block holds it.
        position = (index + 1) * self.block_size
        if position % self.ctx.alignment != 0:
            return False
        if self.align and position != chunk_end:
            if index != self.checkpoints.get(req_id):
                return False
            # A checkpoint at a mere interval multiple is written but not registered.
            return keep.dense or position in keep.state_positions
        return keep.keeps_position(position)


class _StateLookup(GroupLookup):
    def __init__(self, manager: MambaManager, hashes: Sequence[BlockHash]) -> None:
        self.manager = manager
        self.hashes = hashes
        self.unit = manager.block_size
        step = manager.ctx.alignment
        while step % self.unit:
            step += manager.ctx.alignment  # lcm(A, block size): positions a state can serve
        self.step = step
        self._found: dict[int, Block] = {}

    def serve(self, limit: int, drop: bool) -> int:
        position = min(limit, len(self.hashes) * self.unit) // self.step * self.step
        while position > 0:
            block = self.manager._cached(self.hashes, position // self.unit - 1)
            if block is not None:
                self._found[position] = block
                return position
            position -= self.step
        return 0

    def blocks(self, length: int) -> tuple[list[Block], Block | None]:
        if length == 0:
            return [], None
        null = self.manager.pool.null_block
        return [null] * (length // self.unit - 1) + [self._found[length]], None
