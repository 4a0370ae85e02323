"""Every fleet router on the Mooncake trace and on E1 agents, at 4 and 8 replicas, against the
fleet's global ideal and against one engine holding the fleet's whole pool.

Rows: `round-robin`, `least-loaded`, `session`, `prefix-fa`, `prefix-hybrid` at junction
weight 0 (the reconciled hit alone, the router before junctions were scored) and at the
default `JUNCTION_WEIGHT`. Each is simulated once per workload and replica count (the fleet is
deterministic: same seed, same report), precise view, load weight 1.0. "One engine" is a single
replica whose pool is the fleet's blocks together, serving the whole workload: the hit rate a
cache of that size gets without being split, the local-cache ceiling a router works toward.

Prints a markdown table per workload and one JSON object on the last line. Runs `--jobs`
simulations at once (each is one process).

    .venv/bin/python benchmarks/routers.py [--replicas 4,8] [--workloads mooncake,agents]
        [--jobs 2] [--limit 1200] [--agents 40] [--spec eagle]
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from hybridserve.sim.deployment import FleetConfig, SimConfig
from hybridserve.sim.routers import JUNCTION_WEIGHT
from hybridserve.sim.run import fleet_simulation, run_fleet
from hybridserve.sim.workload import AgentParams

MOONCAKE = "mooncake:data/traces/conversation_trace.jsonl"
ROWS: tuple[tuple[str, str, float], ...] = (
    ("round-robin", "round-robin", JUNCTION_WEIGHT),
    ("least-loaded", "least-loaded", JUNCTION_WEIGHT),
    ("session", "session", JUNCTION_WEIGHT),
    ("prefix-fa", "prefix-fa", JUNCTION_WEIGHT),
    ("prefix-hybrid, reconciled hit only (junction weight 0)", "prefix-hybrid", 0.0),
    (f"prefix-hybrid (junction weight {JUNCTION_WEIGHT})", "prefix-hybrid", JUNCTION_WEIGHT),
)


def workload_config(name: str, args: argparse.Namespace) -> SimConfig:
    if name == "mooncake":
        return SimConfig(
            workload=MOONCAKE, limit=args.limit, speculation=args.spec, warmup_s=0.0, seed=0
        )
    if name == "agents":
        return SimConfig(
            agents=AgentParams(num_agents=args.agents),
            duration_s=600.0,
            warmup_s=120.0,
            speculation=args.spec,
            seed=0,
        )
    raise SystemExit(f"--workloads: unknown workload {name!r}; use mooncake or agents")


def _fleet_row(config: SimConfig, replicas: int, router: str, weight: float) -> dict[str, Any]:
    fleet = FleetConfig(replicas=replicas, router=router, junction_weight=weight)
    run = run_fleet(config, fleet)
    report = run.fleet
    return {
        "hit_rate": report["hit_rate"],
        "global_ideal_hit_rate": report["global_ideal_hit_rate"],
        "hit_rate_of_ideal": report["hit_rate_of_ideal"],
        "imbalance": report["imbalance"],
        "slo_requests_per_gpu_hour": report["slo_requests_per_gpu_hour"],
        "job_goodput_per_gpu_hour": report["job_goodput_per_gpu_hour"],
        "ttft_p50_ms": run.run.summary.get("ttft_p50_ms"),
    }


def _one_engine_row(config: SimConfig, replicas: int) -> dict[str, Any]:
    """One replica with the fleet's whole pool (its blocks times `replicas`)."""
    probe = fleet_simulation(config, FleetConfig(replicas=1))
    blocks = probe.replicas[0].scheduler.cache.layout.num_blocks
    pooled = replace(config, num_gpu_blocks_override=blocks * replicas)
    run = run_fleet(pooled, FleetConfig(replicas=1))
    return {
        "hit_rate": run.fleet["hit_rate"],
        "num_blocks": blocks * replicas,
        "ttft_p50_ms": run.run.summary.get("ttft_p50_ms"),
    }


def _task(task: tuple[str, int, str, str, float, argparse.Namespace]) -> dict[str, Any]:
    workload, replicas, label, router, weight, args = task
    started = time.perf_counter()
    config = workload_config(workload, args)
    if router == "one-engine":
        row = _one_engine_row(config, replicas)
    else:
        row = _fleet_row(config, replicas, router, weight)
    row.update(
        workload=workload,
        replicas=replicas,
        router=label,
        junction_weight=weight if router == "prefix-hybrid" else None,
        wall_s=round(time.perf_counter() - started, 1),
    )
    return row


def table(rows: list[dict[str, Any]], workload: str, replicas: list[int]) -> str:
    head = " | ".join(
        f"{n} replicas: hit rate, of ideal, of one engine, imbalance" for n in replicas
    )
    lines = [f"| router | {head} |", "|---|" + "---|" * len(replicas)]
    by_key = {(r["workload"], r["replicas"], r["router"]): r for r in rows}
    for label, _, _ in ROWS:
        cells = []
        for n in replicas:
            row, pooled = by_key[(workload, n, label)], by_key[(workload, n, "one engine")]
            of_pool = row["hit_rate"] / pooled["hit_rate"] if pooled["hit_rate"] else float("nan")
            cells.append(
                f"{row['hit_rate']:.4f}, {row['hit_rate_of_ideal']:.0%}, "
                f"{of_pool:.0%}, {row['imbalance']:.2f}"
            )
        lines.append(f"| `{label}` | " + " | ".join(cells) + " |")
    cells = [f"{by_key[(workload, n, 'one engine')]['hit_rate']:.4f}" for n in replicas]
    lines.append("| one engine, the fleet's pool | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="4,8")
    parser.add_argument("--workloads", default="mooncake,agents")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--limit", type=int, default=1200)
    parser.add_argument("--agents", type=int, default=40)
    parser.add_argument("--spec", default="eagle")
    args = parser.parse_args()
    replicas = [int(n) for n in args.replicas.split(",")]
    workloads = args.workloads.split(",")
    for workload in workloads:
        workload_config(workload, args)  # a bad name fails before any run
    tasks = [
        (w, n, label, router, weight, args)
        for w in workloads
        for n in replicas
        for label, router, weight in (*ROWS, ("one engine", "one-engine", 0.0))
    ]
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = []
        for row in pool.map(_task, tasks):
            rows.append(row)
            print(json.dumps(row), flush=True)
    for workload in workloads:
        print(f"\n{workload}\n\n{table(rows, workload, replicas)}\n", flush=True)
    print(json.dumps({"rows": rows, "wall_s": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
