"""TorchExecutor on CPU: concurrent requests sharing a long prefix, against transformers.

Default: 32 requests, each a shared 1,024-token prefix plus 16 tokens of its own, 64 new tokens
each (greedy, no stop), on SmolLM2-135M-Instruct (models/, `make models`) or, when it is absent,
a tiny random Llama. Measures, one run each: the hybridserve Engine (prefix caching, chunked
prefill, batched decode), transformers `generate` request by request, and transformers
`generate` on the whole batch. Prints one JSON object with tokens/s, the ratios and the prefix
hit tokens.

    .venv/bin/python benchmarks/executor_cpu.py [--requests 32] [--prefix 1024] [--new 64]
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

from hybridserve.cli.builtin_models import builtin_path
from hybridserve.cli.torch_runtime import blocks_for, build_runtime
from hybridserve.core.request import Request, SamplingParams


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


def run_hybridserve(path: Path, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    runtime = build_runtime(
        path,
        num_blocks=blocks_for(
            [len(p) for p in prompts], max_tokens=new_tokens, block_size=16, num_groups=1
        ),
        max_num_seqs=len(prompts),
        max_num_batched_tokens=2048,
        load_tokenizer=False,
    )
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        runtime.engine.add_request(
            Request(req_id=str(i), prompt_token_ids=tuple(prompt), sampling=sampling)
        )
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    hit_tokens = steps = 0
    began = time.perf_counter()
    while runtime.engine.has_requests():
        step = runtime.engine.step()
        steps += 1
        hit_tokens += sum(hit for _, hit in step.scheduled.new_reqs)
        for out in step.outputs:
            outputs[out.req_id].extend(out.new_token_ids)
    wall = time.perf_counter() - began
    generated = sum(len(v) for v in outputs.values())
    return {
        "tok_s": generated / wall,
        "wall_s": wall,
        "steps": steps,
        "prefix_hit_tokens": hit_tokens,
        "first_output": outputs["0"],
    }


def run_transformers(
    model: Any, prompts: list[list[int]], new_tokens: int, *, batched: bool
) -> dict[str, Any]:
    options = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    began = time.perf_counter()
    first: list[int] = []
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
    wall = time.perf_counter() - began
    return {"tok_s": len(prompts) * new_tokens / wall, "wall_s": wall, "first_output": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--tiny", action="store_true", help="use a tiny random Llama")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = builtin_path("smollm2")
        if args.tiny or not path.is_file():
            path = Path(tmp)
            tiny_checkpoint(path)
            name, vocab = "tiny-llama", 512
        else:
            name, vocab = "smollm2-135m-instruct-q4_1", 49152
        gen = torch.Generator().manual_seed(0)
        prefix = torch.randint(100, vocab, (args.prefix,), generator=gen).tolist()
        prompts = [
            prefix + torch.randint(100, vocab, (args.suffix,), generator=gen).tolist()
            for _ in range(args.requests)
        ]
        ours = run_hybridserve(path, prompts, args.new)
        print(f"hybridserve: {ours['wall_s']:.1f} s", file=sys.stderr, flush=True)
        reference = transformers_model(path)
        sequential = run_transformers(reference, prompts, args.new, batched=False)
        print(f"transformers sequential: {sequential['wall_s']:.1f} s", file=sys.stderr, flush=True)
        batched = run_transformers(reference, prompts, args.new, batched=True)
    result = {
        "model": name,
        "num_requests": args.requests,
        "shared_prefix_tokens": args.prefix,
        "new_tokens": args.new,
        "torch_threads": torch.get_num_threads(),
        "hybridserve_tok_s": round(ours["tok_s"], 2),
        "transformers_sequential_tok_s": round(sequential["tok_s"], 2),
        "transformers_batched_tok_s": round(batched["tok_s"], 2),
        "ratio_vs_sequential": round(ours["tok_s"] / sequential["tok_s"], 2),
        "ratio_vs_batched": round(ours["tok_s"] / batched["tok_s"], 2),
        "prefix_hit_tokens": ours["prefix_hit_tokens"],
        "engine_steps": ours["steps"],
        "first_request_output_matches": ours["first_output"] == sequential["first_output"],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
