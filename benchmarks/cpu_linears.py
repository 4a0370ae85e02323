"""Float32 linears on the CPU by row count: `F.linear`, the oneDNN-packed weight, the few-row
kernel (`cpu_kernels.few_rows_linear`, up to 16 rows, where this CPU has AVX-512) and (at one
row) the weight stored transposed.

The projections of the two built-in models (SmolLM2-135M, Gemma 3 270M, their output heads
included) and of the Granite 4.0-H-layout 0.4B hybrid, at the row counts of decode batches and
prefill chunks. Each cell is the median
of `--repeats` calls after two warm-up calls, interleaved (plain, packed) so that a load change
on a shared machine hits all. Prints one JSON object: per shape and row count the milliseconds
of each, `packed_speedup` and `few_rows_speedup` (plain / each), and the path `PackedLinear`
takes there on this machine's CPU (`plain`, `packed` or `few_rows`), with the cells where that
path is not the fastest measured. This is what `hybridserve.executor.torch.layers.packed.
min_packed_rows` and `few_rows_limit` were chosen from (with `--cold`, each call reads its
weight from memory, as a decode step's linears do: the head of the step before evicted them from
the cache).

    .venv/bin/python benchmarks/cpu_linears.py [--threads 2] [--repeats 15]
        [--rows 1,2,3,4,8,16,32,48,64,128,256,512] [--cold MB]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from hybridserve.executor.torch import cpu_kernels
from hybridserve.executor.torch.layers.packed import (
    PACK_ROWS_HINT,
    cpu_vendor,
    few_rows_limit,
    min_packed_rows,
    packing_available,
)

# The most rows the few-row kernel is measured at (it serves up to `few_rows_limit`).
FEW_ROWS_MEASURED = 16

# (name, out_features, in_features)
SHAPES = (
    ("gemma3-270m lm_head", 262_144, 640),
    ("gemma3-270m mlp up", 2_048, 640),
    ("gemma3-270m mlp down", 640, 2_048),
    ("gemma3-270m q", 1_024, 640),
    ("smollm2 lm_head", 49_152, 576),
    ("smollm2 gate+up", 3_072, 576),
    ("smollm2 down", 576, 1_536),
    ("smollm2 qkv", 960, 576),
    ("smollm2 o", 576, 576),
    # The Granite 4.0-H-layout 0.4B hybrid (benchmarks/hybrid_checkpoint.py).
    ("granite4h-0.4b mlp in", 8_192, 1_024),
    ("granite4h-0.4b mamba in", 4_384, 1_024),
    ("granite4h-0.4b mlp out", 1_024, 4_096),
    ("granite4h-0.4b mamba out", 1_024, 2_048),
    ("granite4h-0.4b q", 1_024, 1_024),
    ("granite4h-0.4b lm_head", 49_152, 1_024),
)


def _median_ms(
    calls: list[Callable[[], torch.Tensor]], repeats: int, evict: Callable[[], object]
) -> list[float]:
    """Each call's median wall milliseconds, the calls interleaved, `evict` run (untimed)
    before each."""
    for call in calls:
        call()
        call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            evict()
            start = time.perf_counter()
            call()
            times[i].append(time.perf_counter() - start)
    return [round(statistics.median(t) * 1000, 4) for t in times]


def _path(rows: int, elements: int, few_rows: bool) -> str:
    """The path `PackedLinear` takes for `rows` rows of a weight of `elements` elements
    (`few_rows`: the kernel is loaded and built here)."""
    if rows < min_packed_rows(elements, cpu_vendor()):
        return "plain"
    return "few_rows" if few_rows and rows <= few_rows_limit(cpu_vendor()) else "packed"


def _few_rows_kernel() -> cpu_kernels.CpuKernels | None:
    """The loaded kernels where they have the few-row linear (AVX-512), else None."""
    kernels = cpu_kernels.load()
    return kernels if kernels is not None and kernels.few_rows_built else None


def measure(rows: list[int], repeats: int, cold_mb: int) -> list[dict[str, object]]:
    """`cold_mb` > 0: before each call, read that many MB of other memory (the weight is then
    read from memory, not from the cache)."""
    filler = torch.ones(cold_mb * 2**20 // 4) if cold_mb > 0 else None

    def evict() -> object:
        return None if filler is None else filler.sum()

    few = _few_rows_kernel()
    results: list[dict[str, object]] = []
    for name, out_features, in_features in SHAPES:
        weight = torch.randn(out_features, in_features)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        columns = weight.t().contiguous()
        for count in rows:
            x = torch.randn(count, in_features)
            calls: list[Callable[[], torch.Tensor]] = [
                partial(F.linear, x, weight),
                partial(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], ""),
            ]
            if few is not None and count <= FEW_ROWS_MEASURED:
                calls.append(partial(few.few_rows_linear, x, weight, None))  # type: ignore[arg-type]
            if count == 1:
                calls.append(partial(torch.mm, x, columns))
            times = _median_ms(calls, repeats, evict)
            row: dict[str, object] = {
                "shape": name,
                "out_features": out_features,
                "in_features": in_features,
                "rows": count,
                "plain_ms": times[0],
                "packed_ms": times[1],
                "packed_speedup": round(times[0] / times[1], 3),
                "path": _path(count, weight.numel(), few is not None),
            }
            at = 2
            if few is not None and count <= FEW_ROWS_MEASURED:
                row["few_rows_ms"] = times[at]
                row["few_rows_speedup"] = round(times[0] / times[at], 3)
                at += 1
            if count == 1:
                row["columns_ms"] = times[at]
                row["columns_speedup"] = round(times[0] / times[at], 3)
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


def _slower_paths(results: list[dict[str, object]]) -> list[str]:
    """Cells where the path taken is slower than another path measured there (the transposed
    weight, which no path takes, aside)."""
    slower = []
    for r in results:
        ms = {
            path: float(str(r[key]))
            for path, key in (
                ("plain", "plain_ms"),
                ("packed", "packed_ms"),
                ("few_rows", "few_rows_ms"),
            )
            if key in r
        }
        fastest = min(ms, key=ms.__getitem__)
        if fastest != r["path"]:
            slower.append(f"{r['shape']} x {r['rows']} ({r['path']}; {fastest} faster)")
    return slower


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rows", default="1,2,3,4,8,16,32,48,64,128,256,512")
    parser.add_argument(
        "--cold",
        type=int,
        default=0,
        metavar="MB",
        help="read this many MB of other memory before each call (more than the last-level "
        "cache, e.g. 1024): weights read from memory, as in a decode step",
    )
    args = parser.parse_args()
    if not packing_available(torch.device("cpu"), torch.float32):
        raise SystemExit("this torch build has no oneDNN linear packing: nothing to compare")
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    started = time.perf_counter()
    results = measure(rows, args.repeats, args.cold)
    summary = {
        "cpu_vendor": cpu_vendor(),
        "cold_mb": args.cold,
        "threads": args.threads,
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "repeats": args.repeats,
        "results": results,
        "few_rows_kernel": _few_rows_kernel() is not None,
        "few_rows_limit": few_rows_limit(cpu_vendor()) if _few_rows_kernel() else 0,
        "path_not_fastest": _slower_paths(results),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
