"""Token sharding of a DCP-sharded KV cache: owners, local lengths and slots (SPEC.md 4.1-4.2).

Token `t` of a sequence lives on rank `floor(t / I) mod N`. A rank keeps its tokens in order, so
the `j`-th token it holds is its local position `j`, and block `j // block_size` of the
sequence's block table (the same block ids on every rank) holds it. With `I` dividing
`block_size`, block `b` on every rank holds tokens of `[b * block_size * N, (b + 1) * block_size
* N)`, which is why the coordinator looks sharded groups up in units of `block_size * N`.
"""

from __future__ import annotations

import torch

from hybridserve.kvcache.dcp import dcp_local_seq_lens

__all__ = [
    "global_positions",
    "local_positions",
    "local_seq_lens",
    "num_local_tokens",
    "owner_ranks",
    "slot_mapping",
]


def local_seq_lens(num_tokens: int, *, world_size: int, interleave: int) -> list[int]:
    """Tokens of a length-`num_tokens` sequence that each rank holds; SPEC.md 4.1's formula."""
    return dcp_local_seq_lens(num_tokens, world_size=world_size, interleave=interleave)


def owner_ranks(positions: torch.Tensor, *, world_size: int, interleave: int) -> torch.Tensor:
    """The rank that holds each token position."""
    return torch.div(positions, interleave, rounding_mode="floor") % world_size


def local_positions(positions: torch.Tensor, *, world_size: int, interleave: int) -> torch.Tensor:
    """Each token's index among the tokens of its sequence that its owner holds."""
    stride = interleave * world_size
    return torch.div(positions, stride, rounding_mode="floor") * interleave + positions % interleave


def num_local_tokens(
    num_tokens: torch.Tensor, *, rank: int, world_size: int, interleave: int
) -> torch.Tensor:
    """How many of each sequence's first `num_tokens` tokens `rank` holds (elementwise).

    The tensor form of `dcp_local_seq_lens`; for a query at position p the causal context is
    p + 1 tokens, so this is also the number of local keys the query may attend to.
    """
    base = torch.div(num_tokens, interleave * world_size, rounding_mode="floor") * interleave
    rest = num_tokens - base * world_size
    return base + (rest - rank * interleave).clamp(min=0, max=interleave)


def slot_mapping(
    positions: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    block_size: int,
    rank: int,
    world_size: int,
    interleave: int,
) -> torch.Tensor:
    """Cache slot on `rank` of each row's token, or -1 where another rank holds it.

    `block_tables[i]` is the block table of row i's sequence. A -1 slot means "do not write this
    token's KV here"; it never means "skip this row".
    """
    if block_size % interleave:
        raise ValueError(
            f"block_size={block_size} is not a multiple of interleave={interleave}: a block "
            "would hold tokens of two lookup units"
        )
    local = local_positions(positions, world_size=world_size, interleave=interleave)
    block_index = torch.div(local, block_size, rounding_mode="floor")
    blocks = block_tables.gather(1, block_index.unsqueeze(1)).squeeze(1)
    slots = blocks * block_size + local % block_size
    owned = owner_ranks(positions, world_size=world_size, interleave=interleave) == rank
    return torch.where(owned, slots, torch.full_like(slots, -1))


def global_positions(
    local: torch.Tensor, *, rank: int, world_size: int, interleave: int
) -> torch.Tensor:
    """The sequence position of `rank`'s `local`-th token: the inverse of `local_positions`."""
    group = torch.div(local, interleave, rounding_mode="floor")
    return group * interleave * world_size + rank * interleave + local % interleave
