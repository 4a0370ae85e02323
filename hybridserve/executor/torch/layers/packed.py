"""Linear layers with oneDNN-prepacked weights, for float32 models on the CPU.

`torch.nn.functional.linear` hands a `[M, K] x [N, K]^T` product to a BLAS that re-reads the
weight in its plain row-major layout every call; at the row counts of a decode batch (a few to a
few dozen rows) that runs well below both the core's arithmetic and the memory bandwidth. oneDNN
can reorder a weight once into the blocked layout its kernels stream (`mkldnn._reorder_linear_
weight`), and its linear then reads that copy (`mkldnn._linear_pointwise`) for any row count.
vLLM's CPU backend does the same (`dispatch_cpu_unquantized_gemm`, a oneDNN handle created per
linear at load time).

Measured on a 2-core x86 machine with 2 threads, over 120 float32 projections of SmolLM2-135M's
shapes (576 -> 3072, 1536 -> 576, 576 -> 960, 576 -> 576, 30 of each): 5-32 rows 15-30% faster
than `F.linear`, 1-3 rows 10-20% slower, 48 rows and more within 3%; so only 4-40 rows take
the packed weight (`PACKED_ROWS`). The packed copy costs the
weight's memory again (the plain weight stays: tied embeddings, draft heads and weight loaders
read it). Results differ from `F.linear` by float32 rounding only (a different summation order);
the reference tests hold them to transformers within 1e-4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The row count oneDNN is told to expect when it chooses the packed layout; the packed weight
# serves every row count. vLLM's CPU backend passes 32 too.
PACK_ROWS_HINT = 32
# Row counts the packed weight serves; outside them `F.linear` was as fast or faster on the
# machine above (1-3 rows: 10-20% faster unpacked; 48 rows and more: within 3%).
PACKED_ROWS = range(4, 41)


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build can pack `dtype` linears on `device` (oneDNN, float32, the CPU)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose forward reads a oneDNN-packed copy of its weight. Made from an
    existing `nn.Linear` by `pack_linears` (its class is swapped in place, so parameters, tied
    weights and `state_dict` are unchanged)."""

    _packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under torch.compile the compiler chooses the kernels (and the row count is symbolic).
        if (
            torch.compiler.is_compiling()
            or x.dim() != 2
            or x.shape[0] not in PACKED_ROWS
            or x.dtype != torch.float32
        ):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Pack the weight of every float32 CPU `nn.Linear` of `model` in place. Call it once the
    weights are loaded and on their device: a weight changed afterwards is not seen. Returns how
    many layers were packed (0 where the build cannot pack)."""
    count = 0
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        weight = module.weight
        if not packing_available(weight.device, weight.dtype):
            continue
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
        module.__class__ = PackedLinear
        module._packed = packed
        count += 1
    return count
