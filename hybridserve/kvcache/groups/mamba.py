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
        # Fine-grained hits: a partial-tail checkpoint lives in a block off the table, held
        # until the request's next allocation; a running-state block registered as a partial
        # tail is copied before the request writes its next state into that index.
        self.partial = self.align and ctx.partial_hits
        self.partial_held: dict[str, tuple[Block, int]] = {}
        self.partial_state: dict[str, int] = {}

    def lookup(
        self, hashes: Sequence[BlockHash], cap: int, *, base: Sequence[BlockHash] = ()
    ) -> GroupLookup:
        return _StateLookup(self, hashes, base if self.partial else ())

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
        if self.spec.num_speculative_blocks or (
            self.partial and (req_id in self.partial_held or req_id in self.partial_state)
        ):
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
        # A partial-hit source is only read by the copy that runs before the step: not held.
        indices = self._new_indices(req_id, slots, hit)
        return len(indices) + _num_evictable(hit, self.pool) + self._partial_cost(req_id, slots)

    def _partial_cost(self, req_id: str, slots: SlotRequest) -> int:
        """Blocks a partial tail takes: an off-table checkpoint, a copy of a registered state."""
        if not self.partial:
            return 0
        cost = 0
        target = self._checkpoint_target(slots)
        if target is not None and target % self.block_size:
            cost += 1
        index = self.partial_state.get(req_id)
        if index is not None and index == cdiv(slots.chunk_end, self.block_size) - 1:
            cost += 1
        return cost

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
        """The table index of a chunk's block-grid prefill checkpoint: None when there is none,
        or when it is where the chunk starts (that state exists). A draft-state block already
        at that index is reused."""
        target = self._checkpoint_target(slots)
        if target is None or target % self.block_size:
            return None
        index = target // self.block_size - 1
        if index < 0 or index <= slots.computed // self.block_size - 1:
            return None
        return index

    def _checkpoint_target(self, slots: SlotRequest) -> int | None:
        """The position a chunk's prefill checkpoint holds (vLLM's num_prefill_checkpoint_blocks
        = 1 with its reachable mask): the last retained position strictly inside a chunk that
        starts on the grid and spans a block. Retained: any block end under dense retention, a
        landing or interval position otherwise; with fine-grained hits also a landing at an A
        boundary inside a block (a partial tail). Under `boundary` retention that is the final
        chunk's replay boundary (one block lower under the EAGLE drop)."""
        keep = slots.keep
        if not (self.spec.prefill_checkpoint or slots.received) or keep is None:
            return None
        bs, start, end = self.block_size, slots.computed, slots.chunk_end
        if start % bs or end - start < bs:
            return None
        a = self.ctx.alignment
        if self.partial:
            position = (end - 1) // a * a
            while position > start:
                if position % bs == 0:
                    if keep.keeps_position(position):
                        return position
                elif position in keep.state_positions:
                    return position
                position -= a
            return None
        position = (end - 1) // bs * bs
        while position > start:
            if position % a == 0 and keep.keeps_position(position):
                return position
            position -= bs
        return None

    def add_hit(self, req_id: str, hit: Sequence[Block], cow_src: Block | None) -> None:
        # A partial-tail source is copied before the step runs; it is not held.
        super().add_hit(req_id, hit, None)
        if self.align:
            null = self.pool.null_block
            self.live[req_id] = [i for i, b in enumerate(hit) if b is not null]

    def add_copy_target(self, req_id: str) -> Block:
        block = super().add_copy_target(req_id)
        if self.align:
            self.live.setdefault(req_id, []).append(len(self.tables[req_id]) - 1)
        return block

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
        if self.partial:
            self._partial_allocate(req_id, slots)
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

    def _partial_allocate(self, req_id: str, slots: SlotRequest) -> None:
        """Copy a running state registered as a partial tail before it is overwritten, and take
        the off-table block of a partial-tail checkpoint."""
        bs = self.block_size
        index = self.partial_state.pop(req_id, None)
        table = self.tables[req_id]
        if index is not None and index == cdiv(slots.chunk_end, bs) - 1 and index < len(table):
            shared = table[index]
            table[index] = self.pool.allocate(1)[0]
            self.pool.free((shared,))
        target = self._checkpoint_target(slots)
        if target is not None and target % bs:
            self.partial_held[req_id] = (self.pool.allocate(1)[0], target)

    def held_outside_tables(self) -> list[Block]:
        return [*super().held_outside_tables(), *(block for block, _ in self.partial_held.values())]

    def _release_partial(self, req_id: str) -> None:
        held = self.partial_held.pop(req_id, None)
        if held is not None:
            self.pool.free((held[0],))

    def _release_stale_scratch(self, req_id: str, slots: SlotRequest, new: list[int]) -> None:
        """Draft-state blocks of an earlier step that the state moved past: neither the state
        the chunk starts from, nor one this chunk writes, nor its checkpoint."""
        bs, null = self.block_size, self.pool.null_block
        source = cdiv(slots.computed, bs) - 1
        state = cdiv(slots.chunk_end, bs) - 1
        keep = {source, *range(state, state + self.spec.num_speculative_blocks + 1), *new}
        checkpoint = self._checkpoint_index(slots)
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
        if self.partial_held:
            self._release_partial(req_id)
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
        self.partial_state.pop(req_id, None)
        held = self.partial_held.pop(req_id, None)
        super().free(req_id)
        if held is not None:
            self.pool.free((held[0],))

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
        count = super().register(
            req_id, hashes, num_tokens_to_cache, chunk_end=chunk_end, keep=keep, base=base
        )
        if self.partial and base:
            count += self._register_partial(req_id, num_tokens_to_cache, chunk_end, keep, base)
        return count

    def _register_partial(
        self,
        req_id: str,
        num_tokens_to_cache: int,
        chunk_end: int,
        keep: KeepMask,
        base: Sequence[BlockHash],
    ) -> int:
        """Register a partial tail: the off-table checkpoint, or a chunk ending at one."""
        bs, h = self.block_size, self.ctx.unit // self.ctx.hash_ratio
        count = 0
        held = self.partial_held.get(req_id)
        candidates: list[tuple[Block, int, bool]] = []
        if held is not None:
            candidates.append((held[0], held[1], False))
        table = self.tables.get(req_id)
        if (
            table
            and chunk_end % bs
            and chunk_end % self.ctx.alignment == 0
            and chunk_end in keep.state_positions
        ):
            index = cdiv(chunk_end, bs) - 1
            if index < len(table) and table[index] is not self.pool.null_block:
                candidates.append((table[index], chunk_end, True))
        for block, position, running in candidates:
            if position > num_tokens_to_cache or position // h > len(base) or block.key:
                continue
            key = base[position // h - 1] + self.key_suffix
            if self.pool.register(block, key, self.ctx.group_id):
                self.keys_this_step.add(key)
                count += 1
                self._partial_stored(req_id, position, base)
                if running:
                    self.partial_state[req_id] = cdiv(position, bs) - 1
        self.num_registered += count
        return count

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
    def __init__(
        self, manager: MambaManager, hashes: Sequence[BlockHash], base: Sequence[BlockHash] = ()
    ) -> None:
        self.manager = manager
        self.hashes = hashes
        self.base = base
        self.unit = manager.block_size
        step = manager.ctx.alignment
        while step % self.unit:
            step += manager.ctx.alignment  # lcm(A, block size): positions a state can serve
        self.step = step
        self._found: dict[int, Block] = {}

    def serve(self, limit: int, drop: bool) -> int:
        if self.base:
            # A partial tail is served only exactly at the candidate.
            a = self.manager.ctx.alignment
            h = self.unit // self.manager.ctx.hash_ratio
            tail = limit // a * a
            if tail % self.unit and 0 < tail // h <= len(self.base):
                block = self.manager.pool.get_cached(
                    self.base[tail // h - 1] + self.manager.key_suffix
                )
                if block is not None:
                    self._found[tail] = block
                    return tail
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
        if length % self.unit:
            # A partial tail: the request continues in a copy of that state's block.
            return [null] * (cdiv(length, self.unit) - 1), self._found[length]
        return [null] * (length // self.unit - 1) + [self._found[length]], None
