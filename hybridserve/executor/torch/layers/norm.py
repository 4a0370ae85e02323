"""RMS norms: Llama's (`x * w`) and Gemma's (`x * (1 + w)`), computed in float32."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """`x / rms(x) * weight`; with `offset=True` (Gemma) the weight is applied as `1 + weight`."""

    def __init__(self, dim: int, eps: float, *, offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)
