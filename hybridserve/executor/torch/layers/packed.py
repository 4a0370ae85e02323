"""Linear layers with oneDNN-prepacked weights, for float32 models on the CPU.

`torch.nn.functional.linear` hands a `[M, K] x [N, K]^T` product to a BLAS that re-reads the
weight in its plain row-major layout every call; at the row counts of a decode batch (a few to a
few dozen rows) that runs well below both the core's arithmetic and the memory bandwidth. oneDNN
can reorder a weight once into the blocked layout its kernels stream (`mkldnn._reorder_linear_
weight`), and its linear then reads that copy (`mkldnn._linear_pointwise`) for any row count.
vLLM's CPU backend does the same (`dispatch_cpu_unquantized_gemm`, a oneDNN handle created per
linear at load time).

Measured on a 2-core x86 machine with 2 threads (`benchmarks/cpu_linears.py`, median of 15
calls, float32): at 2-8 rows the packed weight ran 1.5-3x faster than `F.linear` on every
shape of SmolLM2-135M and Gemma 3 270M, the output heads included (Gemma 3's 262,144 x 640 head
at 2 rows: 48 ms against 135); at one row it was faster only on the large matrices (the output
heads: 44 ms against 49 for Gemma 3's, 4.3 against 7.9 for SmolLM2's) and up to 30% slower on
the small projections, which a row reads from cache either way. One row is fastest against
the weight stored transposed (`[in, out]`, contiguous): 27-28 ms for Gemma 3's head at one or
two threads, against 40-44 packed and 49-50 plain, near a plain read of its 671 MB (24 ms);
SmolLM2's 4.6 against 7.0 and 8.6 (one thread). So the packed weight serves 2-40 rows
(`PACKED_ROWS`), and a weight of `SINGLE_ROW_ELEMENTS` or more (the output heads) also keeps a
transposed copy for single rows (a decode batch of one). Each copy costs the weight's memory
again (the plain weight stays: tied embeddings, draft heads and weight loaders read it): for
Gemma 3 270M's head, 671 MB each. Results differ from `F.linear` by float32 rounding only (a
different summation order); the reference tests hold them to transformers within 1e-4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The row count oneDNN is told to expect when it chooses the packed layout; the packed weight
# serves every row count. vLLM's CPU backend passes 32 too.
PACK_ROWS_HINT = 32
# Row counts the packed weight serves; above them `F.linear` was as fast (48 rows and more:
# within 3%), and below them only a large weight gains (see the module's docstring).
PACKED_ROWS = range(2, 41)
# A weight of at least this many elements also keeps a transposed copy for single rows.
SINGLE_ROW_ELEMENTS = 4_000_000


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build can pack `dtype` linears on `device` (oneDNN, float32, the CPU)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose forward reads a oneDNN-packed copy of its weight (and, for one row
    of a large weight, a transposed copy). Made from an existing `nn.Linear` by `pack_linears`
    (its class is swapped in place, so parameters, tied weights and `state_dict` are
    unchanged)."""

    _packed: torch.Tensor
    _columns: torch.Tensor | None  # the weight transposed, [in, out], for single rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under torch.compile the compiler chooses the kernels (and the row count is symbolic).
        rows = x.shape[0] if x.dim() == 2 else 0
        if torch.compiler.is_compiling() or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        if rows == 1 and self._columns is not None:
            if self.bias is None:
                return torch.mm(x, self._columns)
            return torch.addmm(self.bias, x, self._columns)
        if rows not in PACKED_ROWS:
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
        large = weight.numel() >= SINGLE_ROW_ELEMENTS
        module._columns = weight.detach().t().contiguous() if large else None
        count += 1
    return count
