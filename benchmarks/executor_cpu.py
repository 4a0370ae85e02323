"""TorchExecutor on CPU: concurrent requests sharing a long prefix, against transformers.

Default: 32 requests, each a shared 1,024-token prefix plus 16 tokens of its own, 64 new tokens
each (greedy, no stop), on SmolLM2-135M-Instruct (models/, `make models`) or, when it is absent,
a tiny random Llama. Measures, one run each, side by side: the hybridserve Engine (prefix
caching, chunked prefill, batched decode) on those prompts; the Engine on the same number of
prompts of the same length with nothing shared (`unshared`); transformers `generate` on the
whole batch; with `--sequential` also transformers request by request. Each run reports wall
seconds and process CPU seconds (the machine may be shared: CPU time is what other processes'
load inflates least). The prefill saved by the shared prefix is priced from the unshared run:
its prefill seconds per token (each step's time split over its tokens) times the hit tokens.
Prints one JSON object.

    .venv/bin/python benchmarks/executor_cpu.py [--requests 32] [--prefix 1024] [--new 64]
        [--threads N] [--sequential] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine.settings import SettingsSources
from hybridserve.executor.torch.checkpoints import builtin_path
from hybridserve.executor.torch.runtime import keep_freed_memory, set_threads
from hybridserve.offline.runtime import blocks_for, build_runtime


def tiny_checkpoint(folder: Path) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        architectures=["LlamaForCausalLM"],
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(str(folder))
    return model


def transformers_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    if path.is_file():
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def run_hybridserve(
    path: Path,
    prompts: list[list[int]],
    new_tokens: int,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    max_num_batched_tokens: int = 2048,
) -> dict[str, Any]:
    """The Engine on `prompts` (greedy, `new_tokens` each). `num_blocks` defaults to room for
    every request at once in one cache group (a hybrid model's state group needs its own)."""
    lengths = [len(p) for p in prompts]
    runtime = build_runtime(
        path,
        num_blocks=num_blocks
        or blocks_for(lengths, max_tokens=new_tokens, block_size=block_size, num_groups=1),
        block_size=block_size,
        settings=SettingsSources(
            flags=(
                ("max_num_seqs", len(prompts)),
                ("max_num_batched_tokens", max_num_batched_tokens),
            )
        ),
        load_tokenizer=False,
    )
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        runtime.engine.add_request(
            Request(req_id=str(i), prompt_token_ids=tuple(prompt), sampling=sampling)
        )
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    hit_tokens = steps = prefill_tokens = preemptions = 0
    prefill_s = 0.0
    wall0, cpu0 = _clock()
    while runtime.engine.has_requests():
        step = runtime.engine.step()
        steps += 1
        hit_tokens += sum(hit for _, hit in step.scheduled.new_reqs)
        preemptions += len(step.scheduled.preempted)
        chunks = step.scheduled.plan.chunks
        prefill = sum(c.num_tokens for c in chunks if c.num_tokens > 1)
        if prefill:
            total = sum(c.num_tokens for c in chunks)
            prefill_s += step.result.duration_s * prefill / total
            prefill_tokens += prefill
        for out in step.outputs:
            outputs[out.req_id].extend(out.new_token_ids)
    wall1, cpu1 = _clock()
    generated = sum(len(v) for v in outputs.values())
    return {
        "tok_s": generated / (wall1 - wall0),
        "wall_s": wall1 - wall0,
        "cpu_s": cpu1 - cpu0,
        "steps": steps,
        "prefix_hit_tokens": hit_tokens,
        "prefill_tokens": prefill_tokens,
        "prefill_s_per_token": prefill_s / max(prefill_tokens, 1),
        "preemptions": preemptions,
        "outputs": outputs,
    }


def run_transformers(
    model: Any, prompts: list[list[int]], new_tokens: int, *, batched: bool
) -> dict[str, Any]:
    options = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    first: list[int] = []
    wall0, cpu0 = _clock()
    with torch.no_grad():
        if batched:
            ids = torch.tensor(prompts)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
            first = out[0, ids.shape[1] :].tolist()
        else:
            for i, prompt in enumerate(prompts):
                ids = torch.tensor([prompt])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
                if i == 0:
                    first = out[0, ids.shape[1] :].tolist()
    wall1, cpu1 = _clock()
    return {
        "tok_s": len(prompts) * new_tokens / (wall1 - wall0),
        "wall_s": wall1 - wall0,
        "cpu_s": cpu1 - cpu0,
        "first_output": first,
    }


def _side(run: dict[str, Any]) -> dict[str, float]:
    return {
        "tok_s": round(run["tok_s"], 2),
        "wall_s": round(run["wall_s"], 2),
        "cpu_s": round(run["cpu_s"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--sequential", action="store_true", help="also transformers one by one")
    parser.add_argument("--tiny", action="store_true", help="use a tiny random Llama")
    args = parser.parse_args()
    set_threads(args.threads or None)
    keep_freed_memory()  # as `serve` and `generate` do on a CPU
    with tempfile.TemporaryDirectory() as tmp:
        path = builtin_path("smollm2")
        if args.tiny or not path.is_file():
            path = Path(tmp)
            tiny_checkpoint(path)
            name, vocab = "tiny-llama", 512
        else:
            name, vocab = "smollm2-135m-instruct-q4_1", 49152
        gen = torch.Generator().manual_seed(0)
        length = args.prefix + args.suffix
        prefix = torch.randint(100, vocab, (args.prefix,), generator=gen).tolist()
        prompts = [
            prefix + torch.randint(100, vocab, (args.suffix,), generator=gen).tolist()
            for _ in range(args.requests)
        ]
        unshared_prompts = [
            torch.randint(100, vocab, (length,), generator=gen).tolist()
            for _ in range(args.requests)
        ]
        run_hybridserve(path, [p[:64] for p in prompts[:2]], 2)  # warm-up: first-call costs
        ours = run_hybridserve(path, prompts, args.new)
        print(f"hybridserve: {ours['wall_s']:.1f} s", file=sys.stderr, flush=True)
        unshared = run_hybridserve(path, unshared_prompts, args.new)
        print(f"hybridserve unshared: {unshared['wall_s']:.1f} s", file=sys.stderr, flush=True)
        reference = transformers_model(path)
        batched = run_transformers(reference, prompts, args.new, batched=True)
        print(f"transformers batched: {batched['wall_s']:.1f} s", file=sys.stderr, flush=True)
        sequential = None
        if args.sequential:
            sequential = run_transformers(reference, prompts, args.new, batched=False)
            print(f"transformers sequential: {sequential['wall_s']:.1f} s", file=sys.stderr)
    saved_s = ours["prefix_hit_tokens"] * unshared["prefill_s_per_token"]
    result: dict[str, Any] = {
        "model": name,
        "num_requests": args.requests,
        "shared_prefix_tokens": args.prefix,
        "new_tokens": args.new,
        "torch_threads": torch.get_num_threads(),
        "hybridserve": _side(ours),
        "hybridserve_unshared": _side(unshared),
        "transformers_batched": _side(batched),
        "ratio_vs_batched": round(ours["tok_s"] / batched["tok_s"], 2),
        "ratio_vs_batched_cpu": round(batched["cpu_s"] / ours["cpu_s"], 2),
        "prefix_hit_tokens": ours["prefix_hit_tokens"],
        "engine_steps": ours["steps"],
        "shared_faster_by_s": round(unshared["wall_s"] - ours["wall_s"], 2),
        "prefill_saved_s": round(saved_s, 2),
        "shared_saves_at_least_the_prefill": unshared["wall_s"] - ours["wall_s"] >= saved_s,
        "first_request_output_matches": ours["outputs"]["0"] == batched["first_output"],
    }
    if sequential is not None:
        result["transformers_sequential"] = _side(sequential)
        result["ratio_vs_sequential"] = round(ours["tok_s"] / sequential["tok_s"], 2)
        result["first_request_output_matches"] &= ours["outputs"]["0"] == sequential["first_output"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
