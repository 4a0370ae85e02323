"""Experiment E1 over seeds and agent counts: baseline (vLLM) against hybridserve, plus the two
ablations (controls-only, retention-only).

Prints one JSON object: per (agents, seed) the metrics of every preset and the hybridserve /
baseline ratios, then per agent count the mean ratios over seeds. Each run is a full simulated
E1 run (default 1,800 s with a 300 s warm-up), so the whole matrix takes a while; `--workers`
runs them in local processes.

    python benchmarks/e1_matrix.py --agents 10 20 40 --seeds 0 1 2 --workers 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from hybridserve.sim.run import SimConfig, simulate, with_preset
from hybridserve.sim.workload import AgentParams

KEYS = (
    "job_goodput_per_hour",
    "jobs_completed",
    "itl_p50_ms",
    "itl_p99_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "prefix_hit_rate",
    "preemptions",
    "output_tokens_per_s",
)
RATIO_KEYS = ("job_goodput_per_hour", "itl_p99_ms", "ttft_p50_ms", "ttft_p99_ms")


Job = tuple[int, int, str, float, float, tuple[tuple[str, float], ...]]


def run_one(job: Job) -> tuple[int, int, str, dict[str, float]]:
    agents, seed, preset, duration, warmup, controls = job
    base = SimConfig(
        agents=AgentParams(num_agents=agents), seed=seed, duration_s=duration, warmup_s=warmup
    )
    config = with_preset(base, preset)
    if controls and preset in ("hybridserve", "controls-only"):
        config = replace(config, controls=controls)
    summary = simulate(config)
    kept = {k: round(summary[k], 4) for k in KEYS}
    kept.update({k: round(v, 4) for k, v in summary.items() if k.startswith("group")})
    return agents, seed, preset, kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, nargs="+", default=[10, 20, 40])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--presets",
        nargs="+",
        default=["baseline", "hybridserve", "controls-only", "retention-only"],
    )
    parser.add_argument("--duration", type=float, default=1_800.0)
    parser.add_argument("--warmup", type=float, default=300.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument(
        "--controls",
        default="{}",
        help="JSON scheduler overrides for the presets with controls, e.g. '{\"max_num_partial_"
        "prefills\": 2}'",
    )
    args = parser.parse_args()
    controls = tuple(sorted(json.loads(args.controls).items()))
    jobs = [
        (a, s, p, args.duration, args.warmup, controls)
        for a in args.agents
        for s in args.seeds
        for p in args.presets
    ]
    results: dict[tuple[int, int], dict[str, dict[str, float]]] = {}
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for done, (agents, seed, preset, metrics) in enumerate(pool.map(run_one, jobs), 1):
            results.setdefault((agents, seed), {})[preset] = metrics
            print(f"{done}/{len(jobs)} agents={agents} seed={seed} {preset}", file=sys.stderr)
    runs = []
    for (agents, seed), by_preset in sorted(results.items()):
        if "baseline" not in by_preset:
            runs.append({"agents": agents, "seed": seed, "metrics": by_preset, "ratios": {}})
            continue
        base = by_preset["baseline"]
        ratios = {
            preset: {k: round(m[k] / base[k], 4) if base[k] else None for k in RATIO_KEYS}
            for preset, m in by_preset.items()
            if preset != "baseline"
        }
        runs.append({"agents": agents, "seed": seed, "metrics": by_preset, "ratios": ratios})
    means: dict[str, dict[str, dict[str, float]]] = {}
    for agents in args.agents:
        rows = [r for r in runs if r["agents"] == agents and r["ratios"]]
        if not rows:
            continue
        means[str(agents)] = {
            preset: {
                k: round(statistics.mean(r["ratios"][preset][k] or 0.0 for r in rows), 4)
                for k in RATIO_KEYS
            }
            for preset in args.presets
            if preset != "baseline"
        }
    print(json.dumps({"controls": dict(controls), "runs": runs, "mean_ratios": means}))


if __name__ == "__main__":
    main()
