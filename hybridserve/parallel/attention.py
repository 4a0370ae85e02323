"""Reference partial attention over one rank's KV, returning output and log-sum-exp.

These are torch functions over static shapes (on CPU the attention itself runs in PyTorch's
fused flash kernel, which also returns the log-sum-exp): a paged cache is `[num_blocks,
block_size, kv_heads, dim]`, a row's keys are the first `num_local_tokens[row]` tokens of its
sequence that this rank holds, read through the row's block table. Rows with no local keys come
back as `out = 0`, `lse = -inf`; the merge masks them again regardless.
"""

from __future__ import annotations

import torch

__all__ = [
    "gather_local_tokens",
    "partial_attention",
    "partial_attention_chunks",
    "write_owned_slots",
]


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


# PyTorch's CPU flash-attention kernel also returns the log-sum-exp the DCP merge needs; it
# wants one head size for q, k and v and a float mask. Elsewhere the plain computation runs.
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def partial_attention_chunks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of padded chunks over their local keys, with the log-sum-exp: `q` `[B, Q, H,
    D]`, `k` `[B, K, KVH, D]`, `v` `[B, K, KVH, Dv]`, `mask` `[B, Q, K]`. Returns `out` `[B, Q,
    H, Dv]` and `lse` `[B, Q, H]`; a query without a key gets `out = 0`, `lse = -inf`. `H` must
    be a multiple of `KVH` (grouped queries; `KVH = 1` is the MQA form MLA uses)."""
    b, nq, heads, _ = q.shape
    kv_heads = k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    if k.shape[1] == 0:
        return q.new_zeros(b, nq, heads, v.shape[-1]), q.new_full((b, nq, heads), float("-inf"))
    group = heads // kv_heads
    flash = _FLASH_WITH_LSE
    fused = (
        flash is not None
        and q.device.type == "cpu"
        and q.dtype in _FLASH_DTYPES
        and q.shape[-1] == v.shape[-1]
    )
    if fused and flash is not None:
        kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # [B, KVH, K, D]
        if group > 1:
            kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
        bias.masked_fill_(~mask, float("-inf"))
        out, lse = flash(
            q.transpose(1, 2), kh, vh, 0.0, False, attn_mask=bias[:, None], scale=scale
        )
        out, lse = out.transpose(1, 2), lse.transpose(1, 2).to(q.dtype)
        empty = ~mask.any(dim=-1)  # the kernel leaves these rows as 0 / 0
        return out.masked_fill(empty[..., None, None], 0.0), lse.masked_fill(
            empty[..., None], float("-inf")
        )
    qg = q.view(b, nq, kv_heads, group, q.shape[-1])
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k) * scale
    scores.masked_fill_(~mask[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, KVH, G, Q]
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - shift.unsqueeze(-1))
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(b, nq, heads, v.shape[-1])
    return out, lse.permute(0, 3, 1, 2).reshape(b, nq, heads)


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
    `key_mask` `[rows, keys]` (True = attend): `partial_attention_chunks` with one query per
    row. Returns `out` `[rows, heads, dv]` and `lse` `[rows, heads]`; rows without a key get
    `out = 0`, `lse = -inf`.
    """
    out, lse = partial_attention_chunks(q.unsqueeze(1), k, v, key_mask.unsqueeze(1), scale=scale)
    return out[:, 0], lse[:, 0]
