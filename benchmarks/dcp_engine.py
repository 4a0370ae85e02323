"""Offline generation through the Engine at DCP widths 1, 2 and 4 (CPU, gloo): what sharding
the KV costs in wall time, and whether the tokens stay the same.

Builds a small random Llama checkpoint in a temporary folder (or takes `--model PATH`), runs
`--requests` prompts of `--prompt-len` tokens for `--max-tokens` greedy tokens each on one
engine per width (every rank a local process), and prints one JSON object: per width the wall
seconds of the whole job (rank start-up and model load included), of the generation alone
(rank 0, first step to last), output tokens per second of the generation, the number of engine
steps, and whether the tokens equal those of DCP 1. Each rank uses one CPU thread.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine.settings import SettingsSources
from hybridserve.offline.runtime import DcpJob, DcpOutcome, run_dcp_job
from hybridserve.parallel import DcpGroup
from hybridserve.parallel.launch import run_ranks


def tiny_llama(folder: Path, *, hidden: int, layers: int) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=8192,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    return folder


def job(model: Path, args: argparse.Namespace, max_tokens: int) -> DcpJob:
    """`--requests` random prompts, all arriving at once, `max_tokens` greedy tokens each."""
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = tuple(
        Request(
            req_id=str(i),
            prompt_token_ids=tuple(rng.randrange(3, 500) for _ in range(args.prompt_len)),
            sampling=params,
        )
        for i in range(args.requests)
    )
    per_request = -(-(args.prompt_len + max_tokens) // args.block_size) + 1
    return DcpJob(
        model_path=str(model),
        waves=(requests,),
        num_blocks=per_request * args.requests + 16,
        block_size=args.block_size,
        settings=SettingsSources(flags=(("max_num_batched_tokens", args.max_num_batched_tokens),)),
    )


def timed(width: int, dcp_job: DcpJob) -> tuple[float, DcpOutcome]:
    start = time.perf_counter()
    if width == 1:
        torch.set_num_threads(1)
        outcome = run_dcp_job(DcpGroup(), dcp_job)
    else:
        outcome = run_ranks(run_dcp_job, width, dcp_job, timeout_s=3600)[0]
    assert outcome is not None
    return time.perf_counter() - start, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", type=Path, default=None, help="checkpoint folder")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_llama(Path(tmp), hidden=args.hidden, layers=args.layers)
        results, reference = [], None
        for width in args.widths:
            wall_s, outcome = timed(width, job(model, args, args.max_tokens))
            tokens = sum(len(t) for t in outcome.tokens.values())
            reference = reference or outcome.tokens
            results.append(
                {
                    "dcp": width,
                    "wall_s": round(wall_s, 2),
                    "generate_s": round(outcome.generate_s, 2),
                    "output_tokens_per_s": round(tokens / outcome.generate_s, 1),
                    "steps": outcome.num_steps,
                    "tokens_match_dcp1": outcome.tokens == reference,
                }
            )
    print(
        json.dumps(
            {
                "benchmark": "dcp_engine",
                "config": vars(args) | {"model": str(args.model)},
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
