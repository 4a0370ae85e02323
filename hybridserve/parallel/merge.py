"""Exact merge of per-rank partial attention by log-sum-exp, with empty ranks masked (SPEC 4.3).

Rank r attends over its own keys and reports `o_r` (normalised over those keys) and
`s_r = log sum exp(q.k)` over them. The global result is `S = log sum_r exp(s_r)` and
`o = sum_r exp(s_r - S) o_r`. A rank with no keys for a row reports garbage (0, NaN, +inf, an
uninitialised buffer); it must count as `s = -inf`, `o = 0`, and a row no rank holds keys for
must come out as `S = -inf`, `o = 0`, not NaN.
"""

from __future__ import annotations

import torch

__all__ = ["lse_weights", "mask_empty_lse", "mask_empty_rows", "merge_attention_states"]


def mask_empty_lse(lse: torch.Tensor, num_local_tokens: torch.Tensor) -> torch.Tensor:
    """`lse` `[..., rows, heads]` with -inf where the row has no local tokens; NaN and +inf
    become -inf too, as upstream's kernel maps them."""
    dead = (num_local_tokens <= 0).unsqueeze(-1) | torch.isnan(lse) | (lse == float("inf"))
    return lse.masked_fill(dead, float("-inf"))


def mask_empty_rows(
    output: torch.Tensor, lse: torch.Tensor, num_local_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's fill before any reduction: rows without local tokens get `lse=-inf`, `out=0`.

    `output` is `[..., rows, heads, dim]`, `lse` `[..., rows, heads]`, `num_local_tokens`
    `[..., rows]`. Fills, never multiplies, so a NaN in a dead row cannot leak through a zero
    weight.
    """
    lse = mask_empty_lse(lse, num_local_tokens)
    return output.masked_fill((lse == float("-inf")).unsqueeze(-1), 0.0), lse


def lse_weights(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-rank weights `exp(s_r - S)` and the merged `S` from masked LSEs `[ranks, rows, heads]`.

    When every rank is -inf for a row the max is taken as 0 (no `-inf - -inf`) and every weight
    is 0, so the row's merged output is 0 and its LSE -inf.
    """
    peak = lses.amax(dim=0)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    scaled = torch.exp(lses - peak)
    total = scaled.sum(dim=0)
    merged_lse = torch.log(total) + peak
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    return scaled / safe_total, merged_lse


def merge_attention_states(
    outputs: torch.Tensor, lses: torch.Tensor, num_local_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-rank partial attention into the exact global `(out, lse)`.

    `outputs` `[ranks, rows, heads, dim]`, `lses` `[ranks, rows, heads]`, `num_local_tokens`
    `[ranks, rows]`. Where a rank's count is 0 its row may hold anything. Returns `out`
    `[rows, heads, dim]` and `lse` `[rows, heads]`. Does not mutate its inputs.
    """
    if outputs.dim() != 4 or lses.shape != outputs.shape[:3]:
        raise ValueError(
            f"outputs {tuple(outputs.shape)} must be [ranks, rows, heads, dim] and lses "
            f"{tuple(lses.shape)} [ranks, rows, heads]"
        )
    if num_local_tokens.shape != outputs.shape[:2]:
        raise ValueError(
            f"num_local_tokens {tuple(num_local_tokens.shape)} must be [ranks, rows] = "
            f"{tuple(outputs.shape[:2])}"
        )
    if outputs.shape[0] == 0:
        raise ValueError("merge_attention_states needs at least one rank")
    lses = mask_empty_lse(lses, num_local_tokens)
    weights, merged_lse = lse_weights(lses)
    dead = (lses == float("-inf")).unsqueeze(-1)
    # One rank at a time: no [ranks, rows, heads, dim] temporary, accumulated at least in the
    # LSE's precision.
    merged = outputs.new_zeros(
        outputs.shape[1:], dtype=torch.promote_types(outputs.dtype, weights.dtype)
    )
    for rank in range(outputs.shape[0]):
        merged.addcmul_(outputs[rank].masked_fill(dead[rank], 0.0), weights[rank].unsqueeze(-1))
    return merged.to(outputs.dtype), merged_lse
