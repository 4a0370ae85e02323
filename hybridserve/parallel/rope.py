"""Small shared layers of the reference models: RMSNorm and rotary position embedding."""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rms_norm"]

ROPE_THETA = 10000.0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    return x * torch.rsqrt(variance + eps) * weight


def apply_rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[rows, heads, dim]` by each row's position (rotate-half convention)."""
    half = x.shape[-1] // 2
    exponent = torch.arange(half, dtype=torch.float64, device=x.device) / half
    angles = positions.to(torch.float64).unsqueeze(-1) * ROPE_THETA**-exponent
    cos = angles.cos().to(x.dtype).unsqueeze(1)
    sin = angles.sin().to(x.dtype).unsqueeze(1)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
