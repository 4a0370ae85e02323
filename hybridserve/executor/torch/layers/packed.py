"""Linear layers with oneDNN-prepacked weights, for float32 models on the CPU.

`torch.nn.functional.linear` hands a `[M, K] x [N, K]^T` product to a BLAS that re-reads the
weight in its plain row-major layout every call; at the row counts of a decode batch (a few to a
few dozen rows) that runs well below both the core's arithmetic and the memory bandwidth. oneDNN
can reorder a weight once into the blocked layout its kernels stream (`mkldnn._reorder_linear_
weight`), and its linear then reads that copy (`mkldnn._linear_pointwise`) for any row count.
vLLM's CPU backend does the same (`dispatch_cpu_unquantized_gemm`, a oneDNN handle created per
linear at load time).

Measured on a 2-core x86 machine with 2 threads (`benchmarks/cpu_linears.py`, median of 15
interleaved calls, float32; docs/cpu_linears.json): at 2 rows the packed weight ran 1.2-3.8x
faster than `F.linear` on every projection of SmolLM2-135M and Gemma 3 270M, the output heads
included (Gemma 3's 262,144 x 640 head: 27.8 ms against 105.3); at 48-128 rows 1.1-1.8x on
the large weights and 0.90-1.17x on the small projections; at 256 and 512 rows 0.88-1.25x. At
one row it was faster on the weights of a million elements and more (Gemma 3's head 26.0 ms
against 48.4, SmolLM2's gate+up 0.17 against 0.30; Gemma 3's MLP down 0.21 against 0.20) and
up to 1.5x slower on the smaller ones, which a row reads from cache either way (SmolLM2's o,
qkv and down, Gemma 3's q). So the packed weight serves 2-128 rows (`PACKED_ROWS`) and one row
of a weight of `SINGLE_ROW_ELEMENTS` or more. The weight stored transposed (`[in, out]`) read
one row of Gemma 3's head in 26.2 ms in an earlier run (packed 24.6), no faster than the packed
copy, so no third copy is kept. The packed copy costs the weight's memory again (the plain
weight stays: tied embeddings, draft heads and weight loaders read it). Results differ from
`F.linear` by float32 rounding only (a different summation order); the reference tests hold
them to transformers within 1e-4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The row count oneDNN is told to expect when it chooses the packed layout; the packed weight
# serves every row count. vLLM's CPU backend passes 32 too.
PACK_ROWS_HINT = 32
# Row counts the packed weight serves: up to 128 rows it gained on the large weights and was
# within 10% on the small ones; from 256 rows up to 1.13x slower on the smaller projections;
# one row gains only on a large weight (see the module's docstring).
PACKED_ROWS = range(2, 129)
# One row reads the packed weight too when the weight has at least this many elements.
SINGLE_ROW_ELEMENTS = 1_000_000


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
    _single_row: bool  # one row reads the packed weight too (a large weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under torch.compile the compiler chooses the kernels (and the row count is symbolic).
        rows = x.shape[0] if x.dim() == 2 else 0
        if torch.compiler.is_compiling() or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        if rows not in PACKED_ROWS and not (rows == 1 and self._single_row):
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
        assert isinstance(module, PackedLinear)
        module._packed = packed
        module._single_row = weight.numel() >= SINGLE_ROW_ELEMENTS
        count += 1
    return count
