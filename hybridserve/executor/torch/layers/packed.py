"""Linear layers with oneDNN-prepacked weights, for float32 models on the CPU.

`torch.nn.functional.linear` hands a `[M, K] x [N, K]^T` product to a BLAS that re-reads the
weight in its plain row-major layout every call; at the row counts of a decode batch (a few to a
few dozen rows) that runs well below both the core's arithmetic and the memory bandwidth. oneDNN
can reorder a weight once into the blocked layout its kernels stream (`mkldnn._reorder_linear_
weight`), and its linear then reads that copy (`mkldnn._linear_pointwise`) for any row count.
vLLM's CPU backend does the same (`dispatch_cpu_unquantized_gemm`, a oneDNN handle created per
linear at load time).

Measured on a 2-core AMD EPYC host with 2 threads (`benchmarks/cpu_linears.py`, median of 9
interleaved calls, float32, 2026-12-06; docs/cpu_linears.json, 1,024 and 2,048 rows in
docs/cpu_linears_1024_2048.json): the packed weight ran faster than `F.linear` at every row
count from 2 to 2,048 on every projection of SmolLM2-135M, Gemma 3 270M and the Granite
4.0-H-layout 0.4B hybrid, the output heads included: 1.27-2.52x at 32 rows, 1.17-1.88x at 128,
1.06-1.57x at 256-2,048 (a 4,096-row prefill chunk of the hybrid's MLP input, 8,192 x 1,024:
1.21x at 2,048 rows). An earlier run under load (load average 1.9) had put the small
projections at 0.88-0.98x from 256 rows, and the packed weight served only 2-128 rows; a
256-token prefill of the hybrid then took 1.42-1.59 s, 1.17-1.21 s packed (three alternating
runs in one process). At one row it is faster on the weights of a million elements and more
(Gemma 3's head 27.0 ms against 57.9, the hybrid's MLP input 1.43 against 2.37) and not on the
smaller ones, which a row reads from cache either way (SmolLM2's o 0.040 against 0.033). So the
packed weight serves every row count from 2 (`MIN_PACKED_ROWS`) and one row of a weight of
`SINGLE_ROW_ELEMENTS` or more.

On an Intel Xeon host (2 vCPUs, 2026-12-06) the rule differs, and it is chosen by the CPU's
vendor (`min_packed_rows`): there `F.linear` (MKL) reads a weight from memory at the memory
bound at one to three rows, and the packed weight does not. Measured with each call's weight
evicted from the cache first, as in a decode step (`benchmarks/cpu_linears.py --cold 1024`,
docs/cpu_linears_cold_xeon.json), plain / packed: Gemma 3's head 27.0 / 28.2 ms at one row,
31.2 / 30.6 at three, 57.1 / 28.2 at four; its MLP up 0.35 / 0.53 ms at one row, 0.49 / 0.54 at
four, 0.93 / 0.79 at 32. In whole decode steps of Gemma 3 270M (interleaved in one process):
61.6-62.3 ms with the rule above, 56.0-56.5 with F.linear below 4 rows at one decode, 65.2-66.2
against 60.5-61.4 at two, 72.0 against 69.1 at three (F.linear below 3 / 4 rows), and no
difference from four. The weight stored transposed (`[in, out]`) read one row of Gemma
3's head in 26.2 ms in an earlier run (packed 24.6), no faster than the packed copy, so no third
copy is kept. The packed copy costs the weight's memory again (the plain weight stays: tied
embeddings, draft heads and weight loaders read it). Results differ from `F.linear` by float32
rounding only (a different summation order); the reference tests hold them to transformers
within 1e-4.

On that Intel host, 4 to 8 rows (`INTEL_FEW_ROWS`) go through neither library but the few-row
kernel (`cpu_kernels.few_rows_linear`, `few_rows_linear.c`, where the CPU has AVX-512): it
streams the plain weight in tiles of 4 rows with a software prefetch, and at 8 rows reads the
hybrid's projections of 8 MB and more and the three models' heads at 13.5-23.4 GB/s where the
packed copy reaches 9.1-19.0. Cold, 8 rows (docs/cpu_linears_few_rows_xeon.json),
packed / kernel: the hybrid's MLP input 2.29 / 1.71 ms, its Mamba input 1.46 / 1.00, its MLP
output 1.33 / 1.02, its head 10.6 / 8.6; Gemma 3's head 35.3 / 33.1, its MLP up 0.83 / 0.51.
At 1-2 rows `F.linear` reads the small weights faster (its call costs less), so the row rule
above still sends them there. At 12-16 rows the cold calls were faster through the kernel too on
every weight of 1,024 input features or more, but whole decode steps were not: serving those up
to 16 rows made the hybrid's step at 12 requests 138.6-139.8 -> 152.4-155.3 ms and at 16
156.3-156.9 -> 159.7-163.5 (docs/decode_steps_few_rows_wide_trial_xeon.json). The kernel stops at
8, one block of its accumulators.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.executor.torch import cpu_kernels
from hybridserve.executor.torch.cpu_kernels import cpuinfo_line

# The row count oneDNN is told to expect when it chooses the packed layout; the packed weight
# serves every row count. vLLM's CPU backend passes 32 too.
PACK_ROWS_HINT = 32
# The packed weight serves every row count from this one (faster at 2-2,048 rows on every
# projection measured); one row gains only on a large weight (see the module's docstring).
MIN_PACKED_ROWS = 2
# One row reads the packed weight too when the weight has at least this many elements.
SINGLE_ROW_ELEMENTS = 1_000_000
# On Intel CPUs fewer rows than this go through `F.linear` whatever the weight's size (see the
# module's docstring).
INTEL_MIN_PACKED_ROWS = 4
# On Intel CPUs with AVX-512, from INTEL_MIN_PACKED_ROWS to this many rows go through the few-row
# kernel (`cpu_kernels.few_rows_linear`), which reads the plain weight faster than the packed
# copy there (see the module's docstring).
INTEL_FEW_ROWS = 8


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor (`vendor_id` of /proc/cpuinfo, e.g. GenuineIntel, AuthenticAMD); ""
    where it cannot be read."""
    line = cpuinfo_line("vendor_id")
    return line.split(":", 1)[1].strip() if line and ":" in line else ""


def min_packed_rows(elements: int, vendor: str) -> int:
    """The fewest rows that read the packed copy of a weight of `elements` elements on a CPU of
    `vendor` (fewer go through `F.linear`)."""
    if vendor == "GenuineIntel":
        return INTEL_MIN_PACKED_ROWS
    return 1 if elements >= SINGLE_ROW_ELEMENTS else MIN_PACKED_ROWS


def few_rows_limit(vendor: str) -> int:
    """The most rows the few-row kernel serves on a CPU of `vendor` (0: none; where it was not
    measured faster, the libraries serve every row count)."""
    return INTEL_FEW_ROWS if vendor == "GenuineIntel" else 0


def few_rows_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, limit: int
) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` by the few-row kernel where `x` has at most `limit` rows, the
    kernels are loaded and nothing needs gradients; else None."""
    if x.dim() != 2 or not 0 < x.shape[0] <= limit:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    kernels = cpu_kernels.load()
    return None if kernels is None else kernels.few_rows_linear(x, weight, bias)


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
    _min_rows: int  # fewer rows go through F.linear (`min_packed_rows`)
    _few_rows: int  # from _min_rows to this many: the few-row kernel (`few_rows_limit`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under torch.compile the compiler chooses the kernels (and the row count is symbolic).
        rows = x.shape[0] if x.dim() == 2 else 0
        if torch.compiler.is_compiling() or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        if rows < self._min_rows:
            return F.linear(x, self.weight, self.bias)
        few = few_rows_product(x, self.weight, self.bias, self._few_rows)
        if few is not None:
            return few
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


class FusedProjection:
    """Sibling linears that read the same input (q/k/v, gate/up) as one: one product of the
    concatenated weight, its output split in the siblings' order. The siblings' weights become
    views into the concatenated one (no second copy), and the product reads a packed copy of
    it from `min_rows` rows (`F.linear` below, as `PackedLinear`). Made by `pack_linears`;
    not a module, so parameters and `state_dict` keep the siblings' names."""

    def __init__(self, linears: list[nn.Linear], vendor: str) -> None:
        weight = torch.cat([linear.weight.detach() for linear in linears]).contiguous()
        self.splits = [linear.out_features for linear in linears]
        self.weight = weight
        self.bias = (
            torch.cat([linear.bias.detach() for linear in linears])  # type: ignore[union-attr]
            if linears[0].bias is not None
            else None
        )
        start = 0
        for linear, size in zip(linears, self.splits, strict=True):
            linear.weight = nn.Parameter(weight[start : start + size], requires_grad=False)
            if self.bias is not None:
                linear.bias = nn.Parameter(self.bias[start : start + size], requires_grad=False)
            start += size
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        self.min_rows = min_packed_rows(weight.numel(), vendor)
        self.few_rows = few_rows_limit(vendor)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The concatenated output `[rows, sum of the siblings' outputs]`."""
        rows = x.shape[0] if x.dim() == 2 else 0
        if torch.compiler.is_compiling() or x.dtype != torch.float32 or rows < self.min_rows:
            return F.linear(x, self.weight, self.bias)
        few = few_rows_product(x, self.weight, self.bias, self.few_rows)
        if few is not None:
            return few
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each sibling's output, in order (views into one product)."""
        return tuple(self.product(x).split(self.splits, dim=-1))


# The sibling linears fused, by the attribute a module keeps its FusedProjection under.
FUSED_SIBLINGS = {
    "fused_qkv": ("q_proj", "k_proj", "v_proj"),
    "fused_gate_up": ("gate_proj", "up_proj"),
}


def fused(module: nn.Module, name: str) -> FusedProjection | None:
    """`module`'s FusedProjection `name` (`FUSED_SIBLINGS`), None where it was not fused."""
    found = module.__dict__.get(name)
    return found if isinstance(found, FusedProjection) else None


def project_qkv(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`module`'s q, k and v projections of `x`: one fused product where `pack_linears` fused
    them (views into it), else its `q_proj`, `k_proj` and `v_proj`."""
    qkv = fused(module, "fused_qkv")
    if qkv is not None:
        return qkv(x)
    return module.q_proj(x), module.k_proj(x), module.v_proj(x)


def _fusable(module: nn.Module, siblings: tuple[str, ...]) -> list[nn.Linear] | None:
    """`module`'s `siblings`, when all are plain float32 CPU `nn.Linear`s this build can pack,
    of one input size and dtype, with biases on all or none; else None."""
    linears = [getattr(module, sibling, None) for sibling in siblings]
    found = [linear for linear in linears if type(linear) is nn.Linear]
    if len(found) != len(siblings):
        return None
    weight = found[0].weight
    if (
        not packing_available(weight.device, weight.dtype)
        or len({linear.in_features for linear in found}) != 1
        or len({linear.bias is None for linear in found}) != 1
        or any(linear.weight.dtype != weight.dtype for linear in found)
    ):
        return None
    return found


def pack_linears(model: nn.Module, vendor: str | None = None) -> int:
    """Pack the weight of every float32 CPU `nn.Linear` of `model` in place: sibling linears
    that read the same input (`FUSED_SIBLINGS`: q/k/v, gate/up) into one FusedProjection kept
    on their module (the module's forward calls it: `fused`), every other one as a
    PackedLinear. Call it once the weights are loaded and on their device: a weight changed
    afterwards is not seen. `vendor`: the CPU whose row rule applies (`min_packed_rows`; None:
    this machine's). Returns how many linears read a packed weight (0 where the build cannot
    pack)."""
    vendor = cpu_vendor() if vendor is None else vendor
    count = 0
    in_fusions: set[int] = set()
    for module in model.modules():
        for name, siblings in FUSED_SIBLINGS.items():
            found = _fusable(module, siblings)
            if found is not None and fused(module, name) is None:
                module.__dict__[name] = FusedProjection(found, vendor)
                in_fusions.update(id(linear) for linear in found)
                count += len(found)
    for module in model.modules():
        if type(module) is not nn.Linear or id(module) in in_fusions:
            continue
        weight = module.weight
        if not packing_available(weight.device, weight.dtype):
            continue
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
        module.__class__ = PackedLinear
        assert isinstance(module, PackedLinear)
        module._packed = packed
        module._min_rows = min_packed_rows(weight.numel(), vendor)
        module._few_rows = few_rows_limit(vendor)
        count += 1
    return count
