"""The executor's entry point: one layer's attention for a batch of rows on this rank's KV shard."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridserve.parallel.attention import gather_local_tokens, partial_attention, write_owned_slots
from hybridserve.parallel.group import DcpGroup, merge_across_ranks
from hybridserve.parallel.sharding import global_positions

__all__ = ["AttentionRows", "LocalKeys", "dcp_attention", "local_keys"]


@dataclass(frozen=True)
class AttentionRows:
    """The query rows of one step: prefill chunks and decodes alike, one row per token.

    The same object is valid on every rank of the group; each rank derives its own slots and
    key counts from it.
    """

    positions: torch.Tensor  # [rows] position of each row's token in its sequence
    block_tables: torch.Tensor  # [rows, max_blocks] block table of each row's sequence
    block_size: int  # tokens per block on one rank (a block id covers block_size * N tokens)

    def slots(self, dcp: DcpGroup) -> torch.Tensor:
        """This rank's KV slot for each row; -1 where another rank writes the row's KV."""
        return dcp.slot_mapping(self.positions, self.block_tables, self.block_size)


@dataclass(frozen=True)
class LocalKeys:
    """Which of this rank's cached tokens each row may attend to (causal)."""

    num_tokens: torch.Tensor  # [rows] local keys at positions <= the row's position
    mask: torch.Tensor  # [rows, max_tokens] True for the first num_tokens local keys
    positions: torch.Tensor  # [max_tokens] sequence position of local key j on this rank


def local_keys(rows: AttentionRows, dcp: DcpGroup) -> LocalKeys:
    """The causal local-key window of every row. Reads no cache."""
    num_tokens = dcp.num_local_tokens(rows.positions + 1)
    max_tokens = int(num_tokens.max()) if num_tokens.numel() else 0
    index = torch.arange(max_tokens, device=rows.positions.device)
    positions = global_positions(
        index, rank=dcp.rank, world_size=dcp.world_size, interleave=dcp.interleave
    )
    return LocalKeys(num_tokens, index.unsqueeze(0) < num_tokens.unsqueeze(1), positions)


def dcp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: AttentionRows,
    dcp: DcpGroup,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every row over the whole sequence, with KV sharded across `dcp`.

    `q` `[rows, heads, d]` and the rows' new `k`/`v` `[rows, kv_heads, d]` are the same on every
    rank. Writes the rows this rank owns into `k_cache`/`v_cache` (`[num_blocks, block_size,
    kv_heads, d]`, mutated), attends over the local keys and merges across the group. Returns
    `[rows, heads, dv]`, identical on every rank. Earlier tokens (a cached prefix, earlier chunks,
    earlier decodes) must already be in the caches.
    """
    slots = rows.slots(dcp)
    write_owned_slots(k_cache, k, slots)
    write_owned_slots(v_cache, v, slots)
    window = local_keys(rows, dcp)
    max_tokens = window.mask.shape[1]
    keys = gather_local_tokens(k_cache, rows.block_tables, max_tokens)
    values = gather_local_tokens(v_cache, rows.block_tables, max_tokens)
    out, lse = partial_attention(q, keys, values, window.mask, scale=scale)
    merged, _ = merge_across_ranks(out, lse, window.num_tokens, dcp)
    return merged
