"""Throughput of the DCP log-sum-exp merge (`merge_attention_states`) in rows per second.

Prints one JSON object: for each rank count, the median time of one merge of `--rows` rows of
`--heads` x `--dim` partial outputs, and rows/s. A quarter of the ranks are empty for every row
(count 0, NaN in their buffers), so the masking path is always exercised. `--device cuda` runs
the same on a GPU (timed with synchronisation).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hybridserve.parallel import merge_attention_states


def inputs(
    ranks: int, rows: int, heads: int, dim: int, device: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    outputs = torch.randn(ranks, rows, heads, dim, generator=gen).to(device, dtype)
    lses = torch.randn(ranks, rows, heads, generator=gen).to(device, dtype)
    counts = torch.randint(1, 100, (ranks, rows), generator=gen).to(device)
    empty = ranks - max(ranks // 4, 1)
    counts[empty:] = 0
    outputs[empty:] = float("nan")
    return outputs, lses, counts


def time_merge(args: argparse.Namespace, ranks: int) -> dict[str, float | int]:
    dtype = getattr(torch, args.dtype)
    outputs, lses, counts = inputs(ranks, args.rows, args.heads, args.dim, args.device, dtype)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for _ in range(3):
        merge_attention_states(outputs, lses, counts)
    samples = []
    for _ in range(args.repeats):
        sync()
        start = time.perf_counter()
        merged, _ = merge_attention_states(outputs, lses, counts)
        sync()
        samples.append(time.perf_counter() - start)
    if merged.isnan().any():
        raise RuntimeError("an empty rank leaked NaN into the merged output")
    median = statistics.median(samples)
    return {
        "ranks": ranks,
        "median_ms": round(median * 1e3, 4),
        "rows_per_s": round(args.rows / median),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {
        "benchmark": "dcp_merge",
        "device": args.device,
        "dtype": args.dtype,
        "rows": args.rows,
        "heads": args.heads,
        "dim": args.dim,
        "threads": args.threads,
        "results": [time_merge(args, ranks) for ranks in args.ranks],
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
