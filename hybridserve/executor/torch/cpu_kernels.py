"""The CPU kernels, compiled on first use into one library: the paged decode-attention kernel
(`paged_decode.c`), row operations (`row_ops.c`: the RMS norm, greedy sampling's argmax, the
gated MLP's activation and product, the Mamba2 decode step's conv and state updates) and the
linear of a decode batch's few rows (`few_rows_linear.c`, AVX-512 only; `layers/packed.py` says
where it serves) and the chunked scans of a prefill: the gated delta rule
(`gated_delta_chunked.c`) and Mamba2's SSD (`ssd_chunked.c`), AVX-512 only, sharing
`chunk_gemm.h`.

On the CPU, decode attention through the gather path copies every key and value a decode reads
into a contiguous buffer (`GatherBuffers`) and then runs SDPA over the copy: at 32 decodes of
300 tokens on Gemma 3 270M the gathers and SDPA took 59 of a 179 ms step. The kernel reads the
keys in place from the paged cache, one job per (request, KV head) on OpenMP threads, with an
online softmax (see the C source). It covers float32 caches and any head sizes, grouping,
sliding window (a per-request first position) and logit soft-capping.

The row operations replace chains of torch operators that a decode step calls hundreds of times
on a few rows each: `F.rms_norm` is composite on the CPU (six operators, each allocating its
result) and greedy sampling read the logits twice (a sum to check that they are finite, then the
maximum). At one decode of Gemma 3 270M a step calls the norm 109 times.

The library is compiled with the system C compiler (`$CC`, else `cc`) the first time a process
needs it, for this machine's CPU (`-march=native`), into `$XDG_CACHE_HOME/hybridserve/kernels`
(else `~/.cache/...`) under a name hashed from the sources, the flags and the CPU's features, so
later processes load it without compiling. Where no compiler works, or `HYBRIDSERVE_CPU_KERNELS=0`,
`load()` returns None (with one warning for a failed build): attention takes the gather path and
the norms and greedy sampling their torch forms.

The objects are built with `-ffast-math` (vectorised reductions, `expf`) but linked without it:
linking with it would add `crtfastmath.o`, which flushes denormals to zero for the whole process.
It links against `libgomp.so.1`, the OpenMP runtime torch itself loads, so both share one pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "paged_decode.c",
        "row_ops.c",
        "few_rows_linear.c",
        "gated_delta_chunked.c",
        "ssd_chunked.c",
    )
)
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
LINK_FLAGS = ("-shared", "-fopenmp")
ENV_SWITCH = "HYBRIDSERVE_CPU_KERNELS"
# Headers the sources include (hashed with them).
HEADERS = (Path(__file__).with_name("chunk_gemm.h"),)
# The longest chunk the chunked scans take (MAX_CHUNK of gated_delta_chunked.c, ssd_chunked.c).
SCAN_MAX_CHUNK = 64
# The activations `act_mul` computes (row_ops.c's `kind`), by their config names.
ACT_MUL_KINDS = {"gelu_pytorch_tanh": 0, "gelu_new": 0, "silu": 1}


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hybridserve" / "kernels"


def cpuinfo_line(*keys: str) -> str | None:
    """The first line of /proc/cpuinfo starting with one of `keys` (None: none, or no such
    file)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(keys):
                return line
    except OSError:
        pass
    return None


def _cpu_features() -> str:
    """What `-march=native` depends on: the CPU's feature flags (Linux), else the machine."""
    return cpuinfo_line("flags", "Features") or platform.machine() + platform.processor()


def _build(compiler: str, target: Path) -> None:
    """Compile and link the library into `target` (atomically: a finished file or none)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [str(Path(tmp) / f"{source.stem}.o") for source in SOURCES]
        lib = Path(tmp) / target.name
        steps = [
            [compiler, *COMPILE_FLAGS, "-c", str(source), "-o", obj]
            for source, obj in zip(SOURCES, objects, strict=True)
        ]
        steps.append([compiler, *LINK_FLAGS, *objects, "-o", str(lib), "-lm"])
        for argv in steps:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()[-800:]}")
        os.replace(lib, target)


class CpuKernels:
    """The loaded library and its entry points."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        fn = self._lib.paged_decode_f32
        fn.argtypes = [p] * 8 + [i64] * 11 + [f32, f32, i32]
        fn.restype = i32
        self._paged = fn
        self._norm = self._lib.rms_norm_f32
        self._norm.argtypes = [p, p, p, i64, i64, f32, i32, i32]
        self._norm.restype = None
        self._greedy = self._lib.greedy_rows_f32
        self._greedy.argtypes = [p, i64, i64, p, p, i32]
        self._greedy.restype = None
        self._act_mul = self._lib.act_mul_f32
        self._act_mul.argtypes = [p, p, i64, i64, i32, i32]
        self._act_mul.restype = None
        self._ssm_step = self._lib.ssm_step_f32
        self._ssm_step.argtypes = [p] * 6 + [i64] * 5 + [i32]
        self._ssm_step.restype = None
        self._conv_step = self._lib.conv_step_f32
        self._conv_step.argtypes = [p] * 5 + [i64] * 4 + [i32, i32]
        self._conv_step.restype = None
        self._few_rows = self._lib.few_rows_linear_f32
        self._few_rows.argtypes = [p] * 4 + [i64] * 3 + [i32]
        self._few_rows.restype = i32
        self.few_rows_built = bool(self._lib.few_rows_linear_built())
        self._gated_delta = self._lib.gated_delta_chunked_f32
        self._gated_delta.argtypes = [p] * 9 + [i64] * 7 + [i32]
        self._gated_delta.restype = i32
        self.gated_delta_built = bool(self._lib.gated_delta_chunked_built())
        self._ssd = self._lib.ssd_chunked_f32
        self._ssd.argtypes = [p] * 9 + [i64] * 7 + [i32]
        self._ssd.restype = i32
        self.ssd_built = bool(self._lib.ssd_chunked_built())

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool
    ) -> torch.Tensor:
        """`x / rms(x) * weight` over the last dimension (`offset`: `* (1 + weight)`), for a
        float32 CPU `x` and `weight` of that dimension. A new tensor of `x`'s shape."""
        x, weight = x.contiguous(), weight.contiguous()
        out = torch.empty_like(x)
        dim = x.shape[-1]
        rows = x.numel() // dim if dim else 0
        if rows:
            self._norm(
                x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, dim, eps, int(offset),
                torch.get_num_threads(),
            )  # fmt: skip
        return out

    def act_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor | None:
        """`act(gate) * up` of a float32 CPU `[rows, 2 * inter]` fused gate/up projection (the
        gate first), in one pass into a new `[rows, inter]`; None for an activation the kernel
        does not have (`ACT_MUL_KINDS`)."""
        kind = ACT_MUL_KINDS.get(activation)
        if kind is None:
            return None
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=torch.float32)
        if rows and width:
            self._act_mul(
                gate_up.data_ptr(), out.data_ptr(), rows, width // 2, kind,
                torch.get_num_threads(),
            )  # fmt: skip
        return out

    def ssm_step(
        self,
        states: Sequence[torch.Tensor],
        decay: torch.Tensor,
        xdt: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
    ) -> torch.Tensor | None:
        """One Mamba2 decode token for B requests in one pass over each state: every state
        `[H, P, N]` (B separate tensors) becomes `decay * state + xdt (x) b` in place; returns y
        `[B, H, P]` with y[h, p] = state[h, p] . c. decay `[B, H]`, xdt `[B, H, P]`, b and c
        `[B, G, N]` (head h reads group h // (H / G)). None (nothing changed) unless every
        state is a dense float32 CPU `[H, P, N]`."""
        batch, heads, head_dim = xdt.shape
        groups, state_size = b.shape[1], b.shape[2]
        pointers = _state_pointers(states, batch, (heads, head_dim, state_size))
        if pointers is None or heads % groups:
            return None
        decay, xdt, b, c = (t.float().contiguous() for t in (decay, xdt, b, c))
        y = torch.empty(batch, heads, head_dim, dtype=torch.float32)
        if batch:
            self._ssm_step(
                pointers.data_ptr(), decay.data_ptr(), xdt.data_ptr(), b.data_ptr(),
                c.data_ptr(), y.data_ptr(), batch, heads, head_dim, state_size, groups,
                torch.get_num_threads(),
            )  # fmt: skip
        return y

    def conv_step(
        self,
        states: Sequence[torch.Tensor],
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        activation: str | None,
    ) -> torch.Tensor | None:
        """One decode token of a depthwise causal conv1d for B requests, each conv state
        `[C, K - 1]` (B separate tensors) shifted in place: returns `act(conv)` `[B, C]` for
        `x` `[B, C]` (rows dense), `weight` `[C, K]`, `bias` `[C]` or None, `activation`
        "silu" or None. None (nothing changed) for another activation, or unless every tensor
        is float32 on the CPU and every state dense `[C, K - 1]`."""
        if activation not in (None, "silu") or x.dim() != 2 or x.stride(1) != 1:
            return None
        batch, channels = x.shape
        pointers = _state_pointers(states, batch, (channels, weight.shape[1] - 1))
        tensors = [x, weight, *(() if bias is None else (bias,))]
        if pointers is None or weight.shape[0] != channels or not all(map(_float32_cpu, tensors)):
            return None
        weight = weight.contiguous()
        bias = None if bias is None else bias.contiguous()
        out = torch.empty(batch, channels, dtype=torch.float32)
        if batch:
            self._conv_step(
                pointers.data_ptr(), x.data_ptr(), weight.data_ptr(),
                None if bias is None else bias.data_ptr(), out.data_ptr(), batch, channels,
                weight.shape[1], x.stride(0), int(activation == "silu"),
                torch.get_num_threads(),
            )  # fmt: skip
        return out

    def few_rows_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """`x @ weight.T (+ bias)` for a float32 CPU `x` of `[rows, in]` and a contiguous
        float32 `weight` `[out, in]` (`few_rows_linear.c`: at most a few rows, where it reads the
        weight faster than the libraries); a new `[rows, out]`. None where this build has no
        such kernel (no AVX-512) or the tensors are not of that kind: the caller takes its
        torch form."""
        if not (
            self.few_rows_built
            and x.dim() == 2
            and _float32_cpu(x)
            and _float32_cpu(weight)
            and weight.is_contiguous()
            and x.shape[1] == weight.shape[1]
            and (bias is None or (_float32_cpu(bias) and bias.shape == weight.shape[:1]))
        ):
            return None
        x = x.contiguous()
        bias = None if bias is None else bias.contiguous()
        rows, out_features = x.shape[0], weight.shape[0]
        y = torch.empty(rows, out_features, dtype=torch.float32)
        if rows and out_features:
            self._few_rows(
                x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                y.data_ptr(), rows, x.shape[1], out_features, torch.get_num_threads(),
            )  # fmt: skip
        return y

    def gated_delta_chunked(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        chunk_size: int,
        snapshots: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None:
        """`gated_delta_rule_chunked` in one pass per value head (`gated_delta_chunked.c`):
        q, k `[L, Hk, Dk]`, v `[L, Hv, Dv]`, g, beta `[L, Hv]`, state `[Hv, Dk, Dv]` (not
        changed). Returns (outputs, final state, the states after each of `snapshots` tokens),
        or None where this build has no such kernel (no AVX-512) or the inputs are not float32
        CPU tensors of a shape it takes (Dv a multiple of 16, chunks of at most 64 tokens): the
        caller takes its torch form."""
        length, key_heads, dim_k = q.shape
        heads, dim_v = v.shape[1:]
        tensors = (q, k, v, g, beta, state)
        if not (
            self.gated_delta_built
            and all(map(_float32_cpu, tensors))
            and length > 0
            and dim_v % 16 == 0
            and 1 <= chunk_size <= SCAN_MAX_CHUNK
            and heads % key_heads == 0
            and k.shape == q.shape
            and state.shape == (heads, dim_k, dim_v)
            and g.shape == beta.shape == (length, heads)
            and _ascending_within(snapshots, length)
        ):
            return None
        sizes = (key_heads, heads, dim_k, dim_v)
        return _scan(
            self._gated_delta, (q, k, v, g, beta), state, v.shape, sizes, chunk_size, snapshots
        )

    def ssd_chunked(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        state: torch.Tensor,
        chunk_size: int,
        snapshots: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None:
        """Mamba2's `ssd_chunked` with each head's chunk in one pass (`ssd_chunked.c`): x
        `[L, H, P]`, dt `[L, H]`, a `[H]`, b, c `[L, G, N]`, state `[H, P, N]` (not changed).
        Returns (y, final state, the states after each of `snapshots` tokens), or None where
        this build has no such kernel (no AVX-512) or the inputs are not float32 CPU tensors of a
        shape it takes (P a multiple of 16, chunks of at most 64 tokens): the caller takes its
        torch form."""
        length, heads, head_dim = x.shape
        groups, state_size = b.shape[1:]
        if not (
            self.ssd_built
            and all(map(_float32_cpu, (x, dt, a, b, c, state)))
            and length > 0
            and head_dim % 16 == 0
            and 1 <= chunk_size <= SCAN_MAX_CHUNK
            and heads % groups == 0
            and dt.shape == (length, heads)
            and a.shape == (heads,)
            and c.shape == b.shape == (length, groups, state_size)
            and state.shape == (heads, head_dim, state_size)
            and _ascending_within(snapshots, length)
        ):
            return None
        sizes = (heads, head_dim, groups, state_size)
        return _scan(self._ssd, (x, dt, a, b, c), state, x.shape, sizes, chunk_size, snapshots)

    def greedy_rows(self, logits: torch.Tensor) -> list[int] | None:
        """Each row's argmax (the first of tied maxima) of a float32 CPU `[rows, vocab]`, in one
        pass that also checks the values: None when some row holds an infinity or a NaN (the
        caller then decides those rows exactly), else the indices."""
        logits = logits.contiguous()
        rows, vocab = logits.shape
        if vocab == 0:
            return None
        index = torch.empty(rows, dtype=torch.int64)
        clean = torch.empty(rows, dtype=torch.uint8)
        self._greedy(
            logits.data_ptr(), rows, vocab, index.data_ptr(), clean.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if not bool(clean.all()):
            return None
        indices: list[int] = index.tolist()
        return indices

    def paged_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        lows: torch.Tensor,
        ends: torch.Tensor,
        order: torch.Tensor,
        *,
        block_size: int,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor:
        """Attention of `q` `[B, H, D]` (one query per request) over the paged `k_cache` /
        `v_cache` (`[slots, KVH, D]`, rows of the last dimension contiguous): request b sees
        positions `lows[b] <= pos < ends[b]` through its block table `tables[b]` (`[B, W]`).
        `order` `[B]` lists the requests longest first (the order their jobs start in).
        Returns `[B, H, Dv]` float32."""
        b, heads, dim = q.shape
        kv_heads, dim_v = k_cache.shape[1], v_cache.shape[2]
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
                raise ValueError(f"paged decode kernel: {name} must be float32 CPU, rows dense")
        if heads % kv_heads or k_cache.shape[2] != dim or v_cache.shape[1] != kv_heads:
            raise ValueError(
                f"paged decode kernel: q {tuple(q.shape)} does not match the cache "
                f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
            )
        q = q.contiguous()
        out = torch.empty(b, heads, dim_v, dtype=torch.float32)
        failed = self._paged(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            lows.data_ptr(),
            ends.data_ptr(),
            order.data_ptr(),
            out.data_ptr(),
            b,
            heads,
            kv_heads,
            dim,
            dim_v,
            tables.shape[1],
            block_size,
            k_cache.stride(0),
            k_cache.stride(1),
            v_cache.stride(0),
            v_cache.stride(1),
            scale,
            softcap or 0.0,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("paged decode kernel: a thread could not allocate its work buffer")
        return out


def _scan(
    entry: Callable[..., int],
    inputs: tuple[torch.Tensor, ...],
    state: torch.Tensor,
    out_shape: torch.Size,
    sizes: tuple[int, ...],
    chunk_size: int,
    snapshots: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None:
    """Call a chunked scan's entry point (`gated_delta_chunked_f32`, `ssd_chunked_f32`: the five
    inputs, the state advanced in place, the output, the snapshots and their positions, then
    the length, `sizes`, the chunk and the threads) on contiguous copies, the caller's state
    untouched. None where it refuses the shapes."""
    inputs = tuple(t.contiguous() for t in inputs)
    state = state.clone(memory_format=torch.contiguous_format)
    out = torch.empty(out_shape, dtype=torch.float32)
    saved = torch.empty(len(snapshots), *state.shape, dtype=torch.float32)
    positions = torch.tensor(snapshots, dtype=torch.int64)
    done = entry(
        *(t.data_ptr() for t in inputs), state.data_ptr(), out.data_ptr(), saved.data_ptr(),
        positions.data_ptr(), len(snapshots), out_shape[0], *sizes, chunk_size,
        torch.get_num_threads(),
    )  # fmt: skip
    if done < 0:
        raise MemoryError("a chunked scan kernel's thread could not allocate its work buffers")
    if done == 0:
        return None
    return out, state, list(saved.unbind(0))


def _ascending_within(counts: tuple[int, ...], length: int) -> bool:
    """Whether `counts` are distinct, ascending and each in 1..length."""
    return all(0 < n <= length for n in counts) and list(counts) == sorted(set(counts))


def _float32_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu"


def _state_pointers(
    states: Sequence[torch.Tensor], count: int, shape: tuple[int, ...]
) -> torch.Tensor | None:
    """The addresses of `count` states (int64), each a dense float32 CPU tensor of `shape` that
    a kernel advances in place; None where one is not."""
    if len(states) != count or not all(
        _float32_cpu(s) and s.shape == shape and s.is_contiguous() for s in states
    ):
        return None
    return torch.tensor([s.data_ptr() for s in states], dtype=torch.int64)


def switched_off(variable: str) -> bool:
    """Whether the environment variable `variable` turns its feature off (0, false, no, off;
    unset means on)."""
    return os.environ.get(variable, "1").strip().lower() in ("0", "false", "no", "off")


def for_tensor(x: torch.Tensor) -> CpuKernels | None:
    """The kernels for work on `x`'s device: loaded (built on first use) only for a CPU
    tensor, and not under torch.compile."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    return load()


@functools.cache
def load() -> CpuKernels | None:
    """The kernels, compiled (once per machine and source) and loaded; None where they are
    switched off (`HYBRIDSERVE_CPU_KERNELS=0`) or cannot be built, with one warning saying why
    (the callers then take their torch forms)."""
    if switched_off(ENV_SWITCH):
        return None
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        log.warning(
            "no C compiler (%s) for the CPU kernels: decode attention gathers its keys and "
            "norms and greedy sampling take their torch forms (slower). Install one (e.g. "
            "gcc) or set CC.",
            os.environ.get("CC") or "cc",
        )
        return None
    digest = hashlib.sha256()
    sources = (*SOURCES, *HEADERS)
    for part in (*(s.read_bytes() for s in sources), repr((COMPILE_FLAGS, LINK_FLAGS)).encode()):
        digest.update(part)
    digest.update(_cpu_features().encode())
    target = _cache_dir() / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        return CpuKernels(target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning(
            "the CPU kernels could not be built or loaded (%s): decode attention gathers its "
            "keys and norms and greedy sampling take their torch forms (slower). Set %s=0 to "
            "skip trying.",
            error,
            ENV_SWITCH,
        )
        return None
