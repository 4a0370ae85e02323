"""Greedy decode of a tiny model, KV sharded over `--dcp N` ranks, against the unsharded run.

Local processes: `python -m hybridserve.parallel.demo --dcp 2`; one rank per process under
torchrun: `torchrun --standalone --nproc-per-node 2 -m hybridserve.parallel.demo`.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from hybridserve.parallel.demo_models import TINY_MODELS, TinyDecoder
from hybridserve.parallel.demo_runner import DecodeScenario, greedy_dense, run_scenario
from hybridserve.parallel.group import DcpGroup, all_gather_stacked
from hybridserve.parallel.launch import init_from_env, run_ranks, torchrun_env_present

__all__ = ["main", "run_demo"]

MODEL_SEED = 1


def _scenario(world_size: int) -> DecodeScenario:
    """The default scenario with the shared prefix rounded down to a multiple of block_size * N."""
    base = DecodeScenario()
    unit = base.block_size * world_size
    return DecodeScenario(prefix_tokens=base.prefix_tokens // unit * unit)


def demo_rank(dcp: DcpGroup, model: str) -> dict[str, list[int]]:
    """This rank's greedy tokens; every rank of the group must call it."""
    decoder = TinyDecoder(TINY_MODELS[model], seed=MODEL_SEED)
    return run_scenario(decoder, dcp, _scenario(dcp.world_size))


def run_demo(*, dcp: int, model: str = "sparse-mla", interleave: int = 1) -> dict[str, Any]:
    """Run the group (spawned here, or this process's rank under torchrun) and compare."""
    if model not in TINY_MODELS:
        raise ValueError(f"model={model!r}: use one of {sorted(TINY_MODELS)}")
    cfg = TINY_MODELS[model]
    if cfg.attention == "mla" and cfg.mla.num_heads % dcp:
        raise ValueError(
            f"dcp={dcp}: {model} splits its {cfg.mla.num_heads} query heads across the ranks; "
            "use a divisor of the head count"
        )
    # torch wheels built without numpy warn about it at import, once per rank; say it once.
    os.environ.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy:UserWarning")
    if torchrun_env_present():
        group = init_from_env(interleave=interleave)
        mine = demo_rank(group, model)
        names = sorted(mine)
        gathered = all_gather_stacked(torch.tensor([mine[name] for name in names]), group)
        outputs = [dict(zip(names, rank.tolist(), strict=True)) for rank in gathered]
        world_size = group.world_size
    else:
        outputs = run_ranks(demo_rank, dcp, model, interleave=interleave)
        world_size = dcp
    scenario = _scenario(world_size)
    decoder = TinyDecoder(TINY_MODELS[model], seed=MODEL_SEED)
    reference = {
        "a": greedy_dense(decoder, list(scenario.prompt_a), scenario.max_new_tokens),
        "b": greedy_dense(decoder, scenario.prompt_b(), scenario.max_new_tokens),
    }
    return {
        "dcp": world_size,
        "interleave": interleave,
        "model": model,
        "shared_prefix_tokens": scenario.prefix_tokens,
        "tokens": outputs[0],
        "unsharded_tokens": reference,
        "ranks_agree": all(out == outputs[0] for out in outputs),
        "identical": all(out == reference for out in outputs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--dcp", type=int, default=2, help="ranks to spawn (ignored under torchrun)"
    )
    parser.add_argument("--model", default="sparse-mla", choices=sorted(TINY_MODELS))
    parser.add_argument("--interleave", type=int, default=1, choices=[1, 2, 4])
    args = parser.parse_args(argv)
    report = run_demo(dcp=args.dcp, model=args.model, interleave=args.interleave)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps(report))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
