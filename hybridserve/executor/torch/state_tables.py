"""Block-table mirroring and state-snapshot placement for the executor.

The plan sends a running request only the blocks added in a step. Attention groups (and Mamba
groups in `all` mode) append them. A Mamba group in `align` mode places them at table indices:
the state block of the chunk end, cdiv(end, block_size) - 1, the lookahead (draft scratch)
blocks after it, and first, when there is one more block than those, the prefill checkpoint at
cdiv(end, block_size) - 2 (see `MambaManager._new_indices`).
"""

from __future__ import annotations

from collections.abc import Sequence

NULL_BLOCK = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def extend_table(
    table: list[int],
    new_ids: Sequence[int],
    *,
    align: bool,
    chunk_end: int,
    lookahead: int,
    block_size: int,
    req_id: str,
) -> None:
    """Add a step's new blocks to a mirrored table (in place)."""
    if not new_ids:
        return
    if not align:
        table.extend(new_ids)
        return
    state = cdiv(chunk_end, block_size) - 1
    last = max(cdiv(chunk_end + lookahead, block_size) - 1, state)
    free = [i for i in range(max(state, 0), last + 1) if i >= len(table) or table[i] == NULL_BLOCK]
    if len(new_ids) == len(free) + 1:
        indices = [state - 1, *free]
    elif len(new_ids) == len(free):
        indices = free
    else:
        raise ValueError(
            f"request {req_id!r}: {len(new_ids)} new state blocks for table indices {free}; "
            "the executor's table no longer mirrors the cache's"
        )
    for index, block_id in zip(indices, new_ids, strict=True):
        if index >= len(table):
            table.extend([NULL_BLOCK] * (index + 1 - len(table)))
        table[index] = block_id


def state_snapshots(
    table: Sequence[int],
    *,
    start: int,
    num_tokens: int,
    num_draft_tokens: int,
    block_size: int,
    scratch: Sequence[int],
    req_id: str,
) -> tuple[int | None, tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(read slot, snapshot token counts, slots per snapshot) for one chunk of a state group.

    The chunk reads the state of tokens [0, start) from table[cdiv(start, bs) - 1] (zeros at
    0). It saves the state at every block boundary inside its verified tokens whose table entry
    is a real block, and at its verified end; with drafts, the states after the verified end and
    after each draft go to `scratch` (committed after verification).
    """
    read_slot: int | None = None
    if start > 0:
        index = cdiv(start, block_size) - 1
        read_slot = table[index] if index < len(table) else NULL_BLOCK
        if read_slot == NULL_BLOCK:
            raise ValueError(
                f"request {req_id!r}: no state block at table index {index} to resume from "
                f"position {start}"
            )
    verified = num_tokens - num_draft_tokens
    targets: dict[int, list[int]] = {}
    first_boundary = (start // block_size + 1) * block_size
    for boundary in range(first_boundary, start + verified + 1, block_size):
        index = boundary // block_size - 1
        if index < len(table) and table[index] != NULL_BLOCK:
            targets.setdefault(boundary - start, []).append(table[index])
    if not scratch:
        index = cdiv(start + verified, block_size) - 1
        if index < len(table) and table[index] != NULL_BLOCK:
            slots = targets.setdefault(verified, [])
            if table[index] not in slots:
                slots.append(table[index])
    for j, slot in enumerate(scratch):
        targets.setdefault(verified + j, []).append(slot)
    counts = tuple(sorted(targets))
    return read_slot, counts, tuple(tuple(targets[n]) for n in counts)
