"""One engine step of the torch executor on CPU, timed and profiled: where a decode or a prefill
step's time goes, by operator.

`--mode decode`: `--requests` seeded random prompts of `--prompt-tokens` tokens (after
`--shared-prefix` tokens every prompt starts with, cached by the first request before the
others arrive) are prefilled (steps not timed), then `--timed` decode steps are timed one by
one (the median and the fastest), then `--profiled` more run under `torch.profiler`.
`--mode prefill`: `--requests` prompts (default 1) of `--prompt-tokens` tokens prefilled
together (one step when the token budget holds them), fresh prompts each time so nothing is
cached; the first round is a warm-up.
Operators are ranked by self CPU time (the CPU time of the operator itself; a thread's time
counts once per thread, so with 2 threads a step's operators can sum to more than its wall
time), each with its milliseconds and calls per profiled step and its input shapes where
`--shapes` asks for them. The CPU paged decode kernel is one ctypes call: its time is in the
step's, not among the operators.

Prints one JSON object on its last line.

    .venv/bin/python benchmarks/step_profile.py --model DIR_OR_ALIAS [--mode decode]
        [--requests N] [--prompt-tokens 256] [--shared-prefix 0] [--block-size 64] [--num-blocks N]
        [--threads 2] [--timed 12] [--profiled 5] [--top 15] [--shapes]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

import torch

from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine.settings import SettingsSources
from hybridserve.executor.torch.checkpoints import resolve_model
from hybridserve.executor.torch.runtime import keep_freed_memory, set_threads
from hybridserve.offline.runtime import PoolFor, TorchRuntime, build_runtime


def _prompt(rng: random.Random, tokens: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(min(100, vocab // 2), min(30_000, vocab)) for _ in range(tokens))


def _add(
    runtime: TorchRuntime,
    rng: random.Random,
    name: str,
    tokens: int,
    new: int,
    prefix: tuple[int, ...] = (),
) -> None:
    prompt = prefix + _prompt(rng, tokens, runtime.executor.model.vocab_size)
    sampling = SamplingParams(max_tokens=new, ignore_eos=True)
    runtime.engine.add_request(Request(req_id=name, prompt_token_ids=prompt, sampling=sampling))


def _decode_steps(runtime: TorchRuntime, args: argparse.Namespace, rng: random.Random) -> Any:
    """Prefill every request, then a callable running one decode step."""
    engine, new = runtime.engine, args.timed + args.profiled + 8
    prefix = _prompt(rng, args.shared_prefix, runtime.executor.model.vocab_size)
    for i in range(args.requests):
        _add(runtime, rng, f"d{i}", args.prompt_tokens, new, prefix)
        if i == 0 and prefix:  # cached before the others arrive: they share its blocks
            while engine.num_waiting or len(engine.token_ids("d0")) <= len(prefix):
                engine.step()
    length = args.shared_prefix + args.prompt_tokens
    while engine.num_waiting or any(
        len(engine.token_ids(r)) <= length for r in engine.request_ids()
    ):
        engine.step()
    if engine.num_running != args.requests:
        raise SystemExit(
            f"--num-blocks {args.num_blocks}: only {engine.num_running} of --requests "
            f"{args.requests} decode together (the pool is too small); give more blocks, or "
            "leave --num-blocks out to size the pool to the requests"
        )
    return engine.step


def _prefill_steps(runtime: TorchRuntime, args: argparse.Namespace, rng: random.Random) -> Any:
    """A callable running one whole prefill of `--requests` fresh prompts together (and their
    one sampled token each)."""
    count = iter(range(1 << 30))

    def one() -> None:
        for _ in range(args.requests):
            _add(runtime, rng, f"p{next(count)}", args.prompt_tokens, 1)
        while runtime.engine.has_requests():
            runtime.engine.step()

    one()  # warm-up
    return one


def _top_ops(prof: Any, steps: int, top: int, shapes: bool) -> list[dict[str, Any]]:
    events = prof.key_averages(group_by_input_shape=shapes)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    out = []
    for e in ranked:
        row: dict[str, Any] = {
            "op": e.key,
            "self_cpu_ms_per_step": round(e.self_cpu_time_total / 1000 / steps, 3),
            "calls_per_step": round(e.count / steps, 1),
            "share": round(e.self_cpu_time_total / total, 4),
        }
        if shapes:
            row["input_shapes"] = str(e.input_shapes)
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint folder or a built-in alias")
    parser.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    parser.add_argument(
        "--requests", type=int, default=None, help="decode: 8 by default; prefill: 1"
    )
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument(
        "--shared-prefix", type=int, default=0, help="decode: tokens every prompt starts with"
    )
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks (default: enough for every request)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timed", type=int, default=12)
    parser.add_argument("--profiled", type=int, default=5)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--shapes", action="store_true", help="rank by operator and shapes")
    args = parser.parse_args()
    if args.requests is None:
        args.requests = 8 if args.mode == "decode" else 1
    for name in ("requests", "prompt_tokens", "timed", "profiled", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more")
    set_threads(args.threads)
    keep_freed_memory()  # as `serve` and `generate` do on a CPU
    runtime = build_runtime(
        resolve_model(args.model),
        num_blocks=args.num_blocks
        or PoolFor(
            (args.shared_prefix + args.prompt_tokens,) * args.requests,
            args.timed + args.profiled + 8,
        ),
        block_size=args.block_size,
        settings=SettingsSources(preset="baseline"),
        load_tokenizer=False,
    )
    rng = random.Random(0)
    maker = _decode_steps if args.mode == "decode" else _prefill_steps
    step = maker(runtime, args, rng)
    times = []
    for _ in range(args.timed):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with torch.profiler.profile(record_shapes=args.shapes) as prof:
        for _ in range(args.profiled):
            step()
    report = {
        "model": args.model,
        "mode": args.mode,
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "shared_prefix": args.shared_prefix,
        "threads": args.threads,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "step_ms_median": round(statistics.median(times) * 1000, 1),
        "step_ms_min": round(min(times) * 1000, 1),
        "profiled_steps": args.profiled,
        # Cache slots the last step gathered for attention, all layers (0 where the CPU paged
        # kernel read every decode's keys in place).
        "gathered_keys_last_step": runtime.executor.gathered_keys,
        "top_ops": _top_ops(prof, args.profiled, args.top, args.shapes),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
