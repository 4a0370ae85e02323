"""The DCP group a rank belongs to, and the collective steps: gather LSE, rescale, reduce.

The same code runs on `gloo` (CPU) and `nccl` (CUDA): it uses only `all_gather_single`,
`reduce_scatter_single` and `all_reduce` on contiguous tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridserve.core.errors import ConfigError
from hybridserve.parallel.merge import lse_weights, mask_empty_rows, merge_attention_states
from hybridserve.parallel.sharding import num_local_tokens, slot_mapping

__all__ = ["DcpGroup", "all_gather_heads", "all_gather_stacked", "merge_across_ranks"]


@dataclass(frozen=True)
class DcpGroup:
    """One rank's view of its decode-context-parallel group.

    `process_group=None` means the default group; it is never used when `world_size == 1`, so a
    single-process run needs no `torch.distributed` at all.
    """

    rank: int = 0
    world_size: int = 1
    interleave: int = 1
    process_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError("dcp.world_size", self.world_size, "use 1 or more ranks")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError("dcp.rank", self.rank, f"use 0..{self.world_size - 1}")
        if self.interleave < 1:
            raise ConfigError("dcp.interleave", self.interleave, "use 1 or more tokens")

    def num_local_tokens(self, num_tokens: torch.Tensor) -> torch.Tensor:
        """How many of each sequence's first `num_tokens` tokens this rank holds."""
        return num_local_tokens(
            num_tokens, rank=self.rank, world_size=self.world_size, interleave=self.interleave
        )

    def slot_mapping(
        self, positions: torch.Tensor, block_tables: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """This rank's cache slot for each row's token; -1 where another rank holds it."""
        return slot_mapping(
            positions,
            block_tables,
            block_size=block_size,
            rank=self.rank,
            world_size=self.world_size,
            interleave=self.interleave,
        )

    def head_slice(self, num_heads: int) -> slice:
        """The query heads this rank owns when heads are split across the group (TP = DCP)."""
        if num_heads % self.world_size:
            raise ConfigError(
                "num_heads", num_heads, f"use a multiple of the DCP width {self.world_size}"
            )
        per_rank = num_heads // self.world_size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)


def all_gather_stacked(tensor: torch.Tensor, dcp: DcpGroup) -> torch.Tensor:
    """Every rank's `tensor`, stacked on a new leading rank dimension."""
    if dcp.world_size == 1:
        return tensor.unsqueeze(0)
    tensor = tensor.contiguous()
    gathered = tensor.new_empty((dcp.world_size, *tensor.shape))
    if tensor.numel() == 0:  # the same shape on every rank, so every rank skips together
        return gathered
    dist.all_gather_single(gathered.view(-1, *tensor.shape[1:]), tensor, group=dcp.process_group)
    return gathered


def all_gather_heads(local_heads: torch.Tensor, dcp: DcpGroup) -> torch.Tensor:
    """`[rows, heads / N, ...]` on each rank to `[rows, heads, ...]` on every rank, all rows."""
    if dcp.world_size == 1:
        return local_heads
    stacked = all_gather_stacked(local_heads.transpose(0, 1), dcp)
    return stacked.flatten(0, 1).transpose(0, 1)


def merge_across_ranks(
    output: torch.Tensor,
    lse: torch.Tensor,
    num_local_tokens: torch.Tensor,
    dcp: DcpGroup,
    *,
    scatter_heads: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge this rank's partial `(out [rows, heads, d], lse [rows, heads])` with the group's.

    Masks this rank's empty rows, all-gathers the LSEs, scales the local output by its weight and
    sums the outputs: with `all_reduce` (every rank gets every head) or, with
    `scatter_heads=True`, with a reduce-scatter that leaves each rank its own `heads / N`.
    """
    heads = dcp.head_slice(output.shape[1]) if scatter_heads else slice(None)
    if dcp.world_size == 1:
        merged, merged_lse = merge_attention_states(
            output.unsqueeze(0), lse.unsqueeze(0), num_local_tokens.unsqueeze(0)
        )
        return merged[:, heads], merged_lse[:, heads]
    output, lse = mask_empty_rows(output, lse, num_local_tokens)
    weights, merged_lse = lse_weights(all_gather_stacked(lse, dcp))
    scaled = weights[dcp.rank].unsqueeze(-1) * output
    if scaled.numel() == 0:  # the same shape on every rank, so every rank skips together
        return scaled[:, heads], merged_lse[:, heads]
    if not scatter_heads:
        dist.all_reduce(scaled, group=dcp.process_group)
        return scaled, merged_lse
    by_head = scaled.transpose(0, 1).contiguous()
    mine = by_head.new_empty((heads.stop - heads.start, *by_head.shape[1:]))
    dist.reduce_scatter_single(mine, by_head, group=dcp.process_group)
    return mine.transpose(0, 1), merged_lse[:, heads]
