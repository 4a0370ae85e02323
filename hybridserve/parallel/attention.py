"""Reference partial attention over one rank's KV, returning output and log-sum-exp.

These are plain torch functions over static shapes: a paged cache is `[num_blocks, block_size,
kv_heads, dim]`, a row's keys are the first `num_local_tokens[row]` tokens of its sequence that
this rank holds, read through the row's block table. Rows with no local keys come back as
`out = 0`, `lse = -inf`; the merge masks them again regardless.
"""

from __future__ import annotations

import torch

__all__ = ["gather_local_tokens", "partial_attention", "write_owned_slots"]


def write_owned_slots(cache: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Write `values[i]` to slot `slots[i]` of `cache` (`[num_blocks, block_size, ...]`).

    Mutates `cache`. Rows with a negative slot belong to another rank and are not written;
    nothing else about them changes.
    """
    owned = slots >= 0
    flat = cache.view(-1, *cache.shape[2:])
    flat[slots[owned]] = values[owned].to(cache.dtype)


def gather_local_tokens(
    cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """The first `num_tokens` local tokens of each row's sequence: `[rows, num_tokens, ...]`."""
    block_size = cache.shape[1]
    index = torch.arange(num_tokens, device=cache.device)
    blocks = block_tables[:, torch.div(index, block_size, rounding_mode="floor")]
    return cache[blocks, index % block_size]


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor,
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each row over its unmasked keys, with the log-sum-exp.

    `q` `[rows, heads, d]`, `k` `[rows, keys, kv_heads, d]`, `v` `[rows, keys, kv_heads, dv]`,
    `key_mask` `[rows, keys]` (True = attend). `heads` must be a multiple of `kv_heads` (grouped
    queries; `kv_heads=1` is the MQA form MLA uses). Returns `out` `[rows, heads, dv]` and `lse`
    `[rows, heads]`; rows without a key get `out = 0`, `lse = -inf`.
    """
    rows, heads, _ = q.shape
    kv_heads = k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    if k.shape[1] == 0:
        out = q.new_zeros(rows, heads, v.shape[-1])
        return out, q.new_full((rows, heads), float("-inf"))
    group = heads // kv_heads
    qg = q.view(rows, kv_heads, group, q.shape[-1])
    scores = torch.einsum("rkgd,rtkd->rkgt", qg, k) * scale
    scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - shift.unsqueeze(-1))
    out = torch.einsum("rkgt,rtkd->rkgd", probs, v)
    return out.reshape(rows, heads, v.shape[-1]), lse.reshape(rows, heads)
