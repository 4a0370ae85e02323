"""Rotary position embeddings (rotate-half layout), with default, linear and llama3 scaling."""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

from hybridserve.core.errors import ConfigError


def inverse_frequencies(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if scaling is None or kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv, scaling)
    raise ConfigError("config.rope_scaling.rope_type", kind, "use default, linear or llama3")


def _llama3(inv: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """Applies RoPE to q/k `[T, heads, head_dim]` at the given positions."""

    def __init__(self, head_dim: int, base: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.register_buffer(
            "inv_freq", inverse_frequencies(head_dim, base, scaling), persistent=False
        )
        self.attention_factor = 1.0

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, 1, head_dim]` at `positions`. Every layer of a step gets the same
        positions tensor, so they are computed once per step and frequencies (`_STEP_MEMO`)."""
        inv_freq = cast(torch.Tensor, self.inv_freq)
        for entry in _STEP_MEMO:
            if (
                entry[0] is positions
                and entry[2] == self.attention_factor
                and entry[3] == dtype
                and (entry[1] is inv_freq or torch.equal(entry[1], inv_freq))
            ):
                return entry[4], entry[5]
        freqs = positions.float()[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_factor).to(dtype)[:, None, :]
        sin = (emb.sin() * self.attention_factor).to(dtype)[:, None, :]
        if _STEP_MEMO and _STEP_MEMO[0][0] is not positions:
            _STEP_MEMO.clear()  # a new step: drop the last one's tensors
        _STEP_MEMO.append((positions, inv_freq, self.attention_factor, dtype, cos, sin))
        return cos, sin


# (positions, inv_freq, attention_factor, dtype, cos, sin) of the current step's positions, one
# entry per distinct frequency set (Gemma 3 has two); cleared when another positions tensor comes.
_STEP_MEMO: list[
    tuple[torch.Tensor, torch.Tensor, float, torch.dtype, torch.Tensor, torch.Tensor]
] = []


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` (rotate-half layout) in three passes over one new
    tensor, not five passes making five: the halves are updated in place with `addcmul_`
    (equal to float32 rounding: the product and sum may fuse)."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1.0)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out
