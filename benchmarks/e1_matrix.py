"""Experiment E1 over paired seeds and agent counts: a baseline against hybridserve (and, on
request, decode-first with its two ablations controls-only and retention-only), with the three
upper bounds.

Every configuration runs on the same seeds, and a seed fixes every agent's jobs
(hybridserve.sim.workload), so per-seed ratios are paired. Prints one JSON object: per agent
count, each configuration's mean metrics and per-seed job goodput, the ratios hybridserve /
baseline (geometric mean of per-seed ratios, Student-t 95% interval on the log scale, per-seed
values), the bounds' job goodput and each configuration's goodput as a fraction of each bound.

Default: 10 seeds x 20 agents x (baseline, hybridserve, 3 bounds), 1,800 s runs with a 300 s
warm-up: 40 full simulations (the infinite-engine bound takes no engine time). docs/e1.md's
tables are `--duration 600 --warmup 120 --workers 2`: 3 to 10 minutes each on this project's
2-core machine (the bounds and 80 agents take longest).

    python benchmarks/e1_matrix.py --agents 10 20 40 --seeds 10 --workers 2
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from hybridserve.sim.bounds import BOUNDS
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.experiment import (
    baseline_preset,
    paired_report,
    read_tuned,
    run_configs,
    tune_vllm,
)
from hybridserve.sim.run import with_preset
from hybridserve.sim.workload import AgentParams

ABLATIONS = ("decode-first", "controls-only", "retention-only")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[20])
    parser.add_argument("--seeds", type=int, default=10, help="paired seeds 0..N-1")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--baseline", default="vllm", help="vllm, vllm-tuned or legacy")
    parser.add_argument(
        "--tuned",
        type=Path,
        default=None,
        help="--baseline vllm-tuned: the search to use (`hybridserve sweep --space vllm --json`); "
        "without it, 16 draws are searched per agent count on --tune-seed",
    )
    parser.add_argument(
        "--tune-seed",
        type=int,
        default=100,
        help="--baseline vllm-tuned: the seed the search runs on, outside the paired seeds",
    )
    parser.add_argument("--itl-slo-ms", type=float, default=100.0, help="the search's p99 ITL SLO")
    parser.add_argument("--ablations", action="store_true", help="also run the two ablations")
    parser.add_argument("--no-bounds", action="store_true", help="skip the three bounds")
    parser.add_argument("--tp", type=int, default=None)
    parser.add_argument("--dcp", type=int, default=1)
    parser.add_argument("--duration", type=float, default=1_800.0)
    parser.add_argument("--warmup", type=float, default=300.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument(
        "--controls",
        default="{}",
        help="JSON scheduler overrides for hybridserve (and decode-first, controls-only), e.g. "
        "'{\"max_num_partial_prefills\": 2}'",
    )
    args = parser.parse_args()
    if args.seeds < 2:
        parser.error("--seeds: a paired interval needs at least 2 seeds")
    if args.tuned is not None and args.baseline != "vllm-tuned":
        parser.error("--tuned: only with --baseline vllm-tuned")
    overrides = tuple(sorted(json.loads(args.controls).items()))
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    tp = args.tp if args.tp is not None else args.dcp
    base_preset = baseline_preset(args.baseline)
    out: dict[str, object] = {
        "baseline": args.baseline,
        "baseline_preset": base_preset,
        "seeds": seeds,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "tp": tp,
        "dcp": args.dcp,
        "controls": dict(overrides),
        "by_agents": {},
    }
    for agents in args.agents:
        base = SimConfig(
            agents=AgentParams(num_agents=agents),
            duration_s=args.duration,
            warmup_s=args.warmup,
            tp=tp,
            dcp=args.dcp,
        )
        presets = {"baseline": base_preset, "hybridserve": "hybridserve"}
        if args.ablations:
            presets.update({name: name for name in ABLATIONS})
        configs = {}
        for label, name in presets.items():
            config = with_preset(base, name)
            if overrides and name in ("hybridserve", "decode-first", "controls-only"):
                config = replace(config, overrides=overrides)
            configs[label] = config
        if args.baseline == "vllm-tuned":
            configs["baseline"], search = _tuned(configs["baseline"], args)
            out.setdefault("vllm_tuned", {})[str(agents)] = search  # type: ignore[union-attr]
        if not args.no_bounds:
            for bound in BOUNDS:
                configs[bound] = replace(configs["baseline"], bound=bound)

        def log(line: str, agents: int = agents) -> None:
            print(f"agents={agents} {line}", file=sys.stderr)

        results, _ = run_configs(configs, seeds, workers=args.workers, log=log)
        report = paired_report(results, baseline="baseline", ours="hybridserve")
        for label in presets:
            if label in ("baseline", "hybridserve"):
                continue
            report[f"ratios_{label}"] = paired_report(results, baseline="baseline", ours=label)[
                "ratios"
            ]
        out["by_agents"][str(agents)] = report  # type: ignore[index]
    print(json.dumps(out))


def _tuned(config: SimConfig, args: argparse.Namespace) -> tuple[SimConfig, dict[str, object]]:
    """The vllm-tuned baseline: the stored search, or 16 draws on the held-out seed."""
    if args.tuned is not None:
        return read_tuned(config, args.tuned)
    tuned, search = tune_vllm(
        replace(config, seed=args.tune_seed),
        trials=16,
        itl_slo_ms=args.itl_slo_ms,
        workers=args.workers,
        seed=args.tune_seed,
    )
    return replace(tuned, seed=config.seed), {**search, "seed": args.tune_seed}


if __name__ == "__main__":
    main()
