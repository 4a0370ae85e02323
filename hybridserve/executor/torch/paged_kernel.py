"""The CPU paged decode-attention kernel (`paged_decode.c`), compiled on first use.

On the CPU, decode attention through the gather path copies every key and value a decode reads
into a contiguous buffer (`GatherBuffers`) and then runs SDPA over the copy: at 32 decodes of
300 tokens on Gemma 3 270M the gathers and SDPA took 59 of a 179 ms step. The kernel reads the
keys in place from the paged cache, one job per (request, KV head) on OpenMP threads, with an
online softmax (see the C source). It covers float32 caches and any head sizes, grouping,
sliding window (a per-request first position) and logit soft-capping.

It is compiled with the system C compiler (`$CC`, else `cc`) the first time a process needs it,
for this machine's CPU (`-march=native`), into `$XDG_CACHE_HOME/hybridserve/kernels` (else
`~/.cache/...`) under a name hashed from the source, the flags and the CPU's features, so later
processes load it without compiling. Where no compiler works, or `HYBRIDSERVE_CPU_KERNELS=0`,
`load()` returns None (with one warning for a failed build) and attention takes the gather path.

The object is built with `-ffast-math` (vectorised reductions, `expf`) but linked without it:
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
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
LINK_FLAGS = ("-shared", "-fopenmp")
ENV_SWITCH = "HYBRIDSERVE_CPU_KERNELS"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hybridserve" / "kernels"


def _cpu_features() -> str:
    """What `-march=native` depends on: the CPU's feature flags (Linux), else the machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _build(compiler: str, target: Path) -> None:
    """Compile and link the kernel into `target` (atomically: a finished file or none)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "paged_decode.o", Path(tmp) / target.name
        for argv in (
            [compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
            [compiler, *LINK_FLAGS, str(obj), "-o", str(lib), "-lm"],
        ):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()[-800:]}")
        os.replace(lib, target)


class PagedDecodeKernel:
    """The loaded library and its one entry point."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        fn = self._lib.paged_decode_f32
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [p] * 8 + [i64] * 11 + [ctypes.c_float, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(
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
        failed = self._fn(
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


@functools.cache
def load() -> PagedDecodeKernel | None:
    """The kernel, compiled (once per machine and source) and loaded; None where it is switched
    off (`HYBRIDSERVE_CPU_KERNELS=0`) or cannot be built, with one warning saying why."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        log.warning(
            "no C compiler (%s) for the CPU paged decode kernel: decode attention gathers "
            "its keys (slower). Install one (e.g. gcc) or set CC.",
            os.environ.get("CC") or "cc",
        )
        return None
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), repr((COMPILE_FLAGS, LINK_FLAGS)).encode()):
        digest.update(part)
    digest.update(_cpu_features().encode())
    target = _cache_dir() / f"paged_decode-{digest.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        return PagedDecodeKernel(target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning(
            "the CPU paged decode kernel could not be built or loaded (%s): decode attention "
            "gathers its keys (slower). Set %s=0 to skip trying.",
            error,
            ENV_SWITCH,
        )
        return None
