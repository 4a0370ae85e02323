"""RMS norms: Llama's (`x * w`) and Gemma's (`x * (1 + w)`), computed in float32.

A float32 input on the CPU goes through the C row kernel (`cpu_kernels`, one call, one pass per
row) where it is built: a decode step of Gemma 3 270M calls the norm 109 times, and at one
decode the kernel took its step from 62.0-63.0 to 59.4-60.3 ms (interleaved, 2 threads, an
Intel Xeon host). Elsewhere a float32 input goes through `F.rms_norm` (on the CPU
`aten::_fused_rms_norm`: the same passes, driven from C++ instead of six calls from Python), the
same arithmetic as the composite
`x * rsqrt(mean(x^2) + eps) * w` (bit-identical on the shapes measured): 725 against 957 us on
Gemma 3's 2,048 x 640, 17 against 23 us on 32 x 640 (2 threads, medians of 50). Other dtypes
keep the composite form, computed in float32 and cast back (as their reference
implementations do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.executor.torch import cpu_kernels


class RMSNorm(nn.Module):
    """`x / rms(x) * weight`; with `offset=True` (Gemma) the weight is applied as `1 + weight`."""

    def __init__(self, dim: int, eps: float, *, offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # Under torch.compile the compiler fuses the norm itself (a ctypes call would break
            # its graph).
            compiling = torch.compiler.is_compiling()
            if x.device.type == "cpu" and not compiling and (kernels := cpu_kernels.load()):
                return kernels.rms_norm(x, self.weight, self.eps, self.offset)
            weight = 1.0 + self.weight if self.offset else self.weight
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)
