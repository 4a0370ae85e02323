"""Chunked against token-loop prefill of the recurrent layers' scans, at real layer shapes.

The gated delta rule at Qwen3-Next-80B-A3B's shape (16 key heads, 32 value heads, head dim
128; benchmarks/configs/qwen3-next-80b-a3b) and the Mamba2 SSD scan at Nemotron-H-8B's (128
heads of 64, state 128, 8 groups; benchmarks/configs/nemotron-h-8b), each on one request's
chunk of `--tokens` tokens from a nonzero starting state, with a state snapshot every
`--block` tokens as the cache asks for block boundaries. Inputs are made as the layers make
them (L2-normalised q and k per key head, decays from softplus'd time steps).

Both paths run the same inputs: `gated_delta_rule_chunked` / `ssd_chunked` (what the layers run
for prefill: on a CPU with AVX-512 their C kernels, the plain-torch chunked forms measured beside
them as `torch_form`; `form` says which ran) and `gated_delta_rule_recurrent` /
`ssd_recurrent` (the token loop, kept for decode). The loop runs `--loop-tokens` tokens (its
cost per token does not depend on the length, so tokens/s is a per-token rate measured on fewer
tokens when that is smaller than `--tokens`); `max_abs_diff` compares the loop's outputs and
snapshots with the chunked run's over those tokens. Times are the best of `--repeats` runs, in
wall seconds and (`*_cpu_*`) in process CPU seconds, which other processes' load on a shared
machine inflates less. `--threshold` also times both paths at lengths 1..16, where the layers
choose the loop.

Beside each rate, `bound`: the chunked form's matrix-product FLOPs a token (`flops_per_token`),
the rate of its main product at this shape (`product_gflops`, best of 30 calls), the tokens/s
those allow (`chunked_bound_tokens_per_s`), the measured rate's fraction of it, and the most
speedup over the loop the bound allows (`bound_speedup_vs_loop`).

Prints one JSON object on its last line.

    .venv/bin/python benchmarks/recurrent_prefill.py [--tokens 4096] [--loop-tokens 512]
        [--block 544] [--threads 2] [--repeats 3] [--threshold]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hybridserve.executor.torch import cpu_kernels
from hybridserve.executor.torch.layers.gated_delta import (
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    l2_normalize,
)
from hybridserve.executor.torch.layers.mamba2 import ssd_chunked, ssd_recurrent
from hybridserve.executor.torch.layers.recurrence import KERNEL_CHUNK_SIZE, scan_chunk_size
from hybridserve.executor.torch.runtime import keep_freed_memory, set_threads

CONFIGS = Path(__file__).parent / "configs"
Inputs = tuple[torch.Tensor, ...]
Result = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]


def config(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((CONFIGS / name / "config.json").read_text())
    return loaded


def gated_delta_inputs(length: int, gen: torch.Generator) -> tuple[dict[str, int], Inputs]:
    c = config("qwen3-next-80b-a3b")
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    q = l2_normalize(torch.randn(length, hk, dk, generator=gen))
    k = l2_normalize(torch.randn(length, hk, dk, generator=gen))
    v = torch.randn(length, hv, dv, generator=gen)
    a_coef = torch.empty(hv).uniform_(0.0, 16.0, generator=gen)  # Qwen3-Next's A init
    g = -a_coef * F.softplus(torch.randn(length, hv, generator=gen))
    beta = torch.randn(length, hv, generator=gen).sigmoid()
    state = torch.randn(hv, dk, dv, generator=gen) * 0.1
    shape = {"key_heads": hk, "value_heads": hv, "head_k_dim": dk, "head_v_dim": dv}
    return shape, (q * dk**-0.5, k, v, g, beta, state)


def mamba2_inputs(length: int, gen: torch.Generator) -> tuple[dict[str, int], Inputs]:
    c = config("nemotron-h-8b")
    heads, head_dim = c["mamba_num_heads"], c["mamba_head_dim"]
    groups, state_size = c["n_groups"], c["ssm_state_size"]
    x = torch.randn(length, heads, head_dim, generator=gen)
    dt_bias = torch.empty(heads).uniform_(-7.0, -2.0, generator=gen)  # softplus ~ 1e-3..1e-1
    dt = F.softplus(torch.randn(length, heads, generator=gen) + dt_bias)
    a = -torch.empty(heads).uniform_(1.0, 16.0, generator=gen)
    # B and C scaled so that C.B is of order one, as the layer's normalised activations give.
    b = torch.randn(length, groups, state_size, generator=gen) * state_size**-0.25
    c_in = torch.randn(length, groups, state_size, generator=gen) * state_size**-0.25
    state = torch.randn(heads, head_dim, state_size, generator=gen) * 0.1
    shape = {"heads": heads, "head_dim": head_dim, "groups": groups, "state_size": state_size}
    return shape, (x, dt, a, b, c_in, state)


def best_seconds(run: Callable[[], Result], repeats: int) -> tuple[float, float, Result]:
    """The best wall seconds and the best process CPU seconds of `repeats` runs, and a result."""
    wall, cpu, result = float("inf"), float("inf"), None
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = run()
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    if result is None:
        raise ValueError(f"repeats={repeats}: give 1 or more")
    return wall, cpu, result


def prefix(inputs: Inputs, length: int, per_token: frozenset[int]) -> Inputs:
    """The first `length` tokens of the per-token inputs (the others, like the state, whole)."""
    return tuple(x[:length] if i in per_token else x for i, x in enumerate(inputs))


def compare(
    make: Callable[[int, torch.Generator], tuple[dict[str, int], Inputs]],
    kernels: tuple[Callable[..., Result], Callable[..., Result]],
    per_token: frozenset[int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    chunked, loop = kernels
    size = args.chunk_sizes[chunked.__name__]
    shape, inputs = make(args.tokens, torch.Generator().manual_seed(0))
    snaps = tuple(range(args.block, args.tokens + 1, args.block)) if args.block else ()
    loop_tokens = min(args.loop_tokens, args.tokens)
    loop_inputs = prefix(inputs, loop_tokens, per_token)
    inside = tuple(n for n in snaps if n < loop_tokens)
    with torch.no_grad():
        chunk_s, chunk_cpu, (out, _, saved) = best_seconds(
            lambda: chunked(*inputs, chunk_size=size, snapshots=snaps), args.repeats
        )
        loop_s, loop_cpu, (loop_out, loop_final, loop_saved) = best_seconds(
            lambda: loop(*loop_inputs, snapshots=inside), args.repeats
        )
        _, _, (mid,) = chunked(*inputs, chunk_size=size, snapshots=(loop_tokens,))
    # Outputs, the snapshots inside the loop's tokens, and the state after its last token.
    pairs = [(out[:loop_tokens], loop_out), (mid, loop_final)]
    pairs += list(zip(saved[: len(inside)], loop_saved, strict=True))
    max_diff = max(float((a - b).abs().max()) for a, b in pairs)
    chunk_rate, loop_rate = args.tokens / chunk_s, loop_tokens / loop_s
    return {
        "shape": shape,
        "tokens": args.tokens,
        "loop_tokens": loop_tokens,
        "snapshots": len(snaps),
        "chunk_size": size,
        "chunked_tokens_per_s": round(chunk_rate, 1),
        "loop_tokens_per_s": round(loop_rate, 1),
        "speedup_vs_loop": round(chunk_rate / loop_rate, 2),
        # The same from process CPU seconds (less inflated by other processes' load).
        "chunked_tokens_per_cpu_s": round(args.tokens / chunk_cpu, 1),
        "loop_tokens_per_cpu_s": round(loop_tokens / loop_cpu, 1),
        "speedup_vs_loop_cpu": round(args.tokens / chunk_cpu / (loop_tokens / loop_cpu), 2),
        "max_abs_diff": max_diff,
        "max_abs_output": round(float(loop_out.abs().max()), 3),  # the scale max_abs_diff is on
    }


def flops_per_token(name: str, shape: dict[str, int], size: int) -> float:
    """Matrix-product FLOPs a token of the chunked form at chunk size `size` (the UT inverse's
    log2(C) levels of small products are left out). Gated delta: per value head the state read
    with q and with k and written (3 Dk Dv multiply-adds), T diag(beta) (V - ...) and attn @ u
    (C Dv each); per key head q.k and k.k (C Dk each). Mamba2: per head the state read with C
    and written (2 P N), the within-chunk product (C P); per group C.B (C N)."""
    if name == "gated_delta":
        hk, hv = shape["key_heads"], shape["value_heads"]
        dk, dv = shape["head_k_dim"], shape["head_v_dim"]
        return 2.0 * (hv * (3 * dk * dv + 2 * size * dv) + hk * 2 * size * dk)
    h, p, g, n = shape["heads"], shape["head_dim"], shape["groups"], shape["state_size"]
    return 2.0 * (h * (2 * p * n + size * p) + g * size * n)


def product_gflops(name: str, shape: dict[str, int], size: int, calls: int = 30) -> float:
    """GFLOP/s of the chunk loop's main product at this shape (each chunk's starting state read
    by q and k, or by C), best of `calls`: the rate the FLOP bound is priced at."""
    if name == "gated_delta":
        a = torch.randn(shape["value_heads"], 2 * size, shape["head_k_dim"])
        b = torch.randn(shape["value_heads"], shape["head_k_dim"], shape["head_v_dim"])
    else:
        g, per_group = shape["groups"], shape["heads"] // shape["groups"] * shape["head_dim"]
        a, b = (
            torch.randn(g, size, shape["state_size"]),
            torch.randn(g, shape["state_size"], per_group),
        )
    flops = 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        torch.bmm(a, b)
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def bound(name: str, row: dict[str, Any]) -> dict[str, float]:
    """The chunked form's FLOP bound beside its measured rate: tokens/s at the main product's
    rate, the measured rate's fraction of it, and the most speedup over the loop it allows."""
    flops = flops_per_token(name, row["shape"], row["chunk_size"])
    rate = product_gflops(name, row["shape"], row["chunk_size"])
    tokens_per_s = rate * 1e9 / flops
    return {
        "flops_per_token": round(flops),
        "product_gflops": round(rate, 1),
        "chunked_bound_tokens_per_s": round(tokens_per_s, 1),
        "chunked_of_bound": round(row["chunked_tokens_per_s"] / tokens_per_s, 3),
        "bound_speedup_vs_loop": round(tokens_per_s / row["loop_tokens_per_s"], 2),
    }


def torch_form(
    make: Callable[[int, torch.Generator], tuple[dict[str, int], Inputs]],
    chunked: Callable[..., Result],
    args: argparse.Namespace,
    size: int,
) -> dict[str, float]:
    """The plain-torch chunked form on the same inputs (where a C kernel serves the layer): its
    tokens/s, best of `--repeats`."""
    _, inputs = make(args.tokens, torch.Generator().manual_seed(0))
    snaps = tuple(range(args.block, args.tokens + 1, args.block)) if args.block else ()
    with torch.no_grad():
        seconds, _, _ = best_seconds(
            lambda: chunked(*inputs, chunk_size=size, snapshots=snaps, kernel=False),
            args.repeats,
        )
    return {"chunk_size": size, "chunked_tokens_per_s": round(args.tokens / seconds, 1)}


def threshold(
    make: Callable[[int, torch.Generator], tuple[dict[str, int], Inputs]],
    kernels: tuple[Callable[..., Result], Callable[..., Result]],
    args: argparse.Namespace,
) -> dict[str, list[float]]:
    """Milliseconds per call of the chunked and loop paths at lengths 1..16 (best of 5)."""
    out: dict[str, list[float]] = {"chunked_ms": [], "loop_ms": []}
    for length in range(1, 17):
        _, inputs = make(length, torch.Generator().manual_seed(0))
        chunked = functools.partial(
            kernels[0], *inputs, chunk_size=args.chunk_sizes[kernels[0].__name__]
        )
        with torch.no_grad():
            chunk_s, _, _ = best_seconds(chunked, 5)
            loop_s, _, _ = best_seconds(functools.partial(kernels[1], *inputs), 5)
        out["chunked_ms"].append(round(chunk_s * 1e3, 3))
        out["loop_ms"].append(round(loop_s * 1e3, 3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--loop-tokens", type=int, default=512)
    parser.add_argument("--block", type=int, default=544, help="snapshot interval (0: none)")
    parser.add_argument("--chunk", type=int, default=None, help="tokens per chunk (by device)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threshold", action="store_true")
    args = parser.parse_args()
    set_threads(args.threads)
    keep_freed_memory()  # as `serve` and `generate` do on a CPU
    loaded = cpu_kernels.load()
    on_kernel = {  # whether the C kernels serve the layers here
        "gated_delta": loaded is not None and loaded.gated_delta_built,
        "mamba2": loaded is not None and loaded.ssd_built,
    }
    torch_size = scan_chunk_size(torch.device("cpu"))
    args.chunk_sizes = {  # the layers' own choice unless --chunk
        "gated_delta_rule_chunked": args.chunk
        or (KERNEL_CHUNK_SIZE if on_kernel["gated_delta"] else torch_size),
        "ssd_chunked": args.chunk or (KERNEL_CHUNK_SIZE if on_kernel["mamba2"] else torch_size),
    }
    kernels = {  # inputs, (chunked, loop), which inputs are per token
        "gated_delta": (
            gated_delta_inputs,
            (gated_delta_rule_chunked, gated_delta_rule_recurrent),
            frozenset(range(5)),
        ),
        "mamba2": (mamba2_inputs, (ssd_chunked, ssd_recurrent), frozenset({0, 1, 3, 4})),
    }
    result: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_1min": round(os.getloadavg()[0], 2),  # other processes' load, at the start
    }
    for name, (make, pair, per_token) in kernels.items():
        result[name] = compare(make, pair, per_token, args)
        result[name]["bound"] = bound(name, result[name])
        result[name]["form"] = "c_kernel" if on_kernel[name] else "torch"
        if on_kernel[name]:  # the torch form beside it, at its own chunk size
            result[name]["torch_form"] = torch_form(make, pair[0], args, torch_size)
        if args.threshold:
            result[name]["threshold"] = threshold(make, pair, args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
