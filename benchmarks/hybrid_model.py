"""The random-init Granite 4.0-H-shaped checkpoint (benchmarks/hybrid_checkpoint.py) on CPU:
hybridserve's engine against transformers batched `generate`, and whole-model prefill of the
hybrid against the same-size dense model in hybridserve's executor.

Three parts, in one process, at `--threads` torch threads for both sides:

* `greedy_check`: one `--check-prompt`-token prompt, `--check-new` greedy tokens, hybridserve
  against transformers on the hybrid checkpoint: tokens identical, and the largest difference
  of the logits that chose them (transformers' from one forward over prompt and answer).
* `throughput`: `--requests` seeded random prompts of `--prompt-tokens` tokens, `--new` tokens
  each (greedy, no stop), through the hybridserve Engine (offline, as
  benchmarks/executor_cpu.py runs it: chunked prefill, batched decode, `--block-size` tokens a
  block, a pool sized so every request fits) and through transformers `generate` on the whole
  batch (equal-length prompts: no padding). Requests/s, output tokens/s, wall and process CPU
  seconds, and hybridserve / transformers ratios; how many requests' outputs are identical.
* `prefill`: one `--prefill-tokens` prompt (one chunk: the token budget is the prompt) through
  the Engine on the hybrid and on the dense checkpoint; prefill tokens/s from the executor's
  step time (best of `--repeats`, a fresh prompt each, so no prefix hit), and the hybrid's
  rate over the dense one's.

Prints one JSON object on its last line. A first-call warm-up precedes each timed part.

    .venv/bin/python benchmarks/hybrid_model.py [--threads N] [--requests 16]
        [--prompt-tokens 256] [--new 64] [--prefill-tokens 4096] [--repeats 2]
        [--shape 0.4b] [--tokenizer DIR] [--skip-throughput] [--skip-prefill]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from executor_cpu import run_hybridserve, run_transformers, transformers_model
from hybrid_checkpoint import SHAPES, checkpoints, parameters

from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine.settings import SettingsSources
from hybridserve.executor.torch.runtime import keep_freed_memory, set_threads
from hybridserve.offline.runtime import build_runtime

# Blocks a request holds at once in a Mamba2 state group of `align` mode: the running state,
# the one it was read from, and a prefill checkpoint.
STATE_BLOCKS_PER_REQUEST = 3


def pool_blocks(lengths: list[int], new_tokens: int, block_size: int) -> int:
    """Room for every request at once: its attention blocks plus its state blocks, and slack.
    (Every state layer holds one state per block id, so a pool sized for the attention group
    twice over would cost the states' memory twice.)"""
    attention = sum(-(-(n + new_tokens + block_size) // block_size) for n in lengths)
    return attention + STATE_BLOCKS_PER_REQUEST * len(lengths) + 16


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def greedy_check(folder: Path, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """hybridserve's greedy tokens and logits against transformers' on the same checkpoint."""
    runtime = build_runtime(folder, num_blocks=64, block_size=16, load_tokenizer=False)
    runtime.executor.record_logits = True
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    runtime.engine.add_request(
        Request(req_id="r0", prompt_token_ids=tuple(prompt), sampling=sampling)
    )
    ours: list[int] = []
    while runtime.engine.has_requests():
        for out in runtime.engine.step().outputs:
            ours.extend(out.new_token_ids)
    our_logits = torch.stack(runtime.executor.recorded_logits["r0"])
    del runtime
    gc.collect()
    model = transformers_model(folder)
    with torch.no_grad():
        options = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
        ids = torch.tensor([prompt])
        theirs = model.generate(ids, attention_mask=torch.ones_like(ids), **options)[0]
        # The logits that chose each answer token, from one pass over prompt and our answer.
        whole = torch.tensor([prompt + ours])
        logits = model(input_ids=whole, use_cache=False).logits[0, len(prompt) - 1 : -1]
    top2 = logits.float().topk(2, dim=-1).values
    return {
        "prompt_tokens": len(prompt),
        "new_tokens": new_tokens,
        "tokens_identical": ours == theirs[len(prompt) :].tolist(),
        "max_abs_logit_diff": float((our_logits - logits.float()).abs().max()),
        "max_abs_logit": round(float(logits.abs().max()), 4),
        "min_top2_margin": float((top2[:, 0] - top2[:, 1]).min()),
        "all_finite": bool(torch.isfinite(our_logits).all()),
    }


def _side(run: dict[str, Any], requests: int, new_tokens: int) -> dict[str, Any]:
    wall, cpu = run["wall_s"], run["cpu_s"]
    return {
        "requests_per_s": round(requests / wall, 4),
        "output_tokens_per_s": round(requests * new_tokens / wall, 2),
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
    }


def throughput(folder: Path, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    prompts = random_prompts(args.requests, args.prompt_tokens, vocab, seed=1)
    lengths = [len(p) for p in prompts]
    blocks = pool_blocks(lengths, args.new, args.block_size)
    options = {"block_size": args.block_size, "num_blocks": blocks}
    run_hybridserve(folder, random_prompts(2, 32, vocab, seed=2), 2, **options)  # warm-up
    ours = run_hybridserve(folder, prompts, args.new, **options)
    gc.collect()  # the engine's model and states, before transformers loads its copy
    print(f"hybridserve: {ours['wall_s']:.1f} s", file=sys.stderr, flush=True)
    reference = transformers_model(folder)
    run_transformers(reference, random_prompts(2, 32, vocab, seed=2), 2, batched=True)
    batched = run_transformers(reference, prompts, args.new, batched=True)
    print(f"transformers batched: {batched['wall_s']:.1f} s", file=sys.stderr, flush=True)
    del reference
    n = args.requests
    return {
        "requests": n,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new,
        "block_size": args.block_size,
        "num_blocks": blocks,
        "preemptions": ours["preemptions"],
        "hybridserve": _side(ours, n, args.new),
        "transformers_batched": _side(batched, n, args.new),
        "ratio_requests_per_s": round(batched["wall_s"] / ours["wall_s"], 3),
        "ratio_cpu": round(batched["cpu_s"] / ours["cpu_s"], 3),
        "first_request_output_identical": ours["outputs"]["0"] == batched["first_output"],
    }


def prefill_rate(
    folder: Path, length: int, repeats: int, vocab: int, block_size: int
) -> dict[str, Any]:
    """Best prefill tokens/s of one `length`-token prompt, from the executor's step time."""
    runtime = build_runtime(
        folder,
        num_blocks=pool_blocks([length], 1, block_size),  # finished prompts' are evictable
        block_size=block_size,
        settings=SettingsSources(flags=(("max_num_batched_tokens", length),)),
        load_tokenizer=False,
    )
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    best, steps = float("inf"), 0
    for i, prompt in enumerate(random_prompts(repeats + 1, length, vocab, seed=10)):
        request = Request(req_id=f"p{i}", prompt_token_ids=tuple(prompt), sampling=sampling)
        runtime.engine.add_request(request)
        seconds, steps = 0.0, 0
        while runtime.engine.has_requests():
            step = runtime.engine.step()
            if step.scheduled.plan.chunks:
                seconds += step.result.duration_s
                steps += 1
        if i:  # the first is the warm-up
            best = min(best, seconds)
    return {"tokens_per_s": round(length / best, 1), "seconds": round(best, 3), "steps": steps}


def prefill(folders: dict[str, Path], args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rates = {
        kind: prefill_rate(folder, args.prefill_tokens, args.repeats, vocab, args.block_size)
        for kind, folder in folders.items()
    }
    # The hybrid's prefill time over the dense model's (the goal: at most 1.5).
    ratio = rates["dense"]["tokens_per_s"] / rates["hybrid"]["tokens_per_s"]
    return {
        "prompt_tokens": args.prefill_tokens,
        **rates,
        "hybrid_time_over_dense": round(ratio, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.4b", choices=sorted(SHAPES))
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--check-prompt", type=int, default=16)
    parser.add_argument("--check-new", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    args = parser.parse_args()
    set_threads(args.threads or None)
    keep_freed_memory()  # as `serve` and `generate` do on a CPU
    folders = checkpoints(args.shape, tokenizer=args.tokenizer)
    vocab = SHAPES[args.shape].vocab_size
    result: dict[str, Any] = {
        "shape": args.shape,
        "parameters": {kind: parameters(folder) for kind, folder in folders.items()},
        "torch_threads": torch.get_num_threads(),
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    check_prompt = random_prompts(1, args.check_prompt, vocab, seed=0)[0]
    result["greedy_check"] = greedy_check(folders["hybrid"], check_prompt, args.check_new)
    if not args.skip_throughput:
        result["throughput"] = throughput(folders["hybrid"], args, vocab)
    if not args.skip_prefill:
        result["prefill"] = prefill(folders, args, vocab)
    result["elapsed_s"] = round(time.perf_counter() - START, 1)
    print(json.dumps(result))


START = time.perf_counter()

if __name__ == "__main__":
    main()
