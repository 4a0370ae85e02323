"""Every fleet router on the Mooncake trace and on E1 agents, at 4 and 8 replicas, against the
fleet's global ideal and against one engine holding the fleet's whole pool.

Rows: `round-robin`, `least-loaded`, `session`, and at each load weight of `--load-weights`
`prefix-fa` and `prefix-hybrid` at junction weight 0 (the reconciled hit alone, the router
before junctions were scored) and at the default `JUNCTION_WEIGHT`. Each is simulated once per
workload and replica count (the fleet is deterministic: same seed, same report), precise view.
"One engine" is a single replica whose pool is the fleet's blocks together, serving the whole
workload: the hit rate a cache of that size gets without being split, the local-cache ceiling a
router works toward. "One engine, 10x the fleet's pool" is about the hit rate the cache's
retention allows when the pool never runs out (on Mooncake it equals one engine with 8
replicas' pool, so the pool no longer limits it). One engine serves the whole load, so its
queue and its timing differ from a fleet's: neither row is a strict bound. Goodput is the
workload's: SLO requests per GPU-hour on Mooncake, jobs per GPU-hour on agents.

Prints a markdown table per workload and one JSON object on the last line. Runs `--jobs`
simulations at once (each is one process).

    .venv/bin/python benchmarks/routers.py [--replicas 4,8] [--workloads mooncake,agents]
        [--load-weights 0.02,0.1,0.3,1.0] [--jobs 2] [--limit 1200] [--agents 40] [--spec eagle]
        [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from hybridserve.sim.deployment import FleetConfig, SimConfig
from hybridserve.sim.routers import JUNCTION_WEIGHT, LOAD_WEIGHT
from hybridserve.sim.run import fleet_simulation, run_fleet
from hybridserve.sim.workload import AgentParams

MOONCAKE = "mooncake:data/traces/conversation_trace.jsonl"
# (label, router, junction weight); the prefix routers run at every load weight.
LOADLESS: tuple[tuple[str, str, float], ...] = (
    ("round-robin", "round-robin", JUNCTION_WEIGHT),
    ("least-loaded", "least-loaded", JUNCTION_WEIGHT),
    ("session", "session", JUNCTION_WEIGHT),
)
PREFIX: tuple[tuple[str, str, float], ...] = (
    ("prefix-fa", "prefix-fa", JUNCTION_WEIGHT),
    ("prefix-hybrid, reconciled hit only (junction weight 0)", "prefix-hybrid", 0.0),
    (f"prefix-hybrid (junction weight {JUNCTION_WEIGHT})", "prefix-hybrid", JUNCTION_WEIGHT),
)
# The one-engine rows: (label, router) and the multiple of the fleet's pool each gets.
ONE_ENGINE = ("one engine", "one-engine")
UNBOUNDED = ("one engine, 10x the fleet's pool", "one-engine-x10")
CEILINGS = {ONE_ENGINE[1]: 1, UNBOUNDED[1]: 10}
GOODPUT = {"mooncake": "slo_requests_per_gpu_hour", "agents": "job_goodput_per_gpu_hour"}


def rows_of(load_weights: list[float]) -> list[tuple[str, str, float, float]]:
    """(label, router, junction weight, load weight) for every fleet row."""
    rows = [(label, router, jw, LOAD_WEIGHT) for label, router, jw in LOADLESS]
    for weight in load_weights:
        rows += [(f"{label}, load weight {weight:g}", r, jw, weight) for label, r, jw in PREFIX]
    return rows


def workload_config(name: str, args: argparse.Namespace) -> SimConfig:
    if name == "mooncake":
        return SimConfig(
            workload=MOONCAKE, limit=args.limit, speculation=args.spec, warmup_s=0.0, seed=args.seed
        )
    if name == "agents":
        return SimConfig(
            agents=AgentParams(num_agents=args.agents),
            duration_s=600.0,
            warmup_s=120.0,
            speculation=args.spec,
            seed=args.seed,
        )
    raise SystemExit(f"--workloads: unknown workload {name!r}; use mooncake or agents")


def _fleet_row(
    config: SimConfig, replicas: int, router: str, weight: float, load_weight: float
) -> dict[str, Any]:
    fleet = FleetConfig(
        replicas=replicas, router=router, junction_weight=weight, load_weight=load_weight
    )
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


def _one_engine_row(config: SimConfig, replicas: int, scale: int) -> dict[str, Any]:
    """One replica with `scale` times the fleet's whole pool (its blocks times `replicas`)."""
    probe = fleet_simulation(config, FleetConfig(replicas=1))
    blocks = probe.replicas[0].scheduler.cache.layout.num_blocks * replicas * scale
    pooled = replace(config, num_gpu_blocks_override=blocks)
    run = run_fleet(pooled, FleetConfig(replicas=1))
    return {
        "hit_rate": run.fleet["hit_rate"],
        "num_blocks": blocks,
        "ttft_p50_ms": run.run.summary.get("ttft_p50_ms"),
    }


def _task(task: tuple[str, int, str, str, float, float, argparse.Namespace]) -> dict[str, Any]:
    workload, replicas, label, router, weight, load_weight, args = task
    started = time.perf_counter()
    config = workload_config(workload, args)
    if router in CEILINGS:
        row = _one_engine_row(config, replicas, CEILINGS[router])
    else:
        row = _fleet_row(config, replicas, router, weight, load_weight)
    prefix = router.startswith("prefix")
    row.update(
        workload=workload,
        replicas=replicas,
        router=label,
        junction_weight=weight if router == "prefix-hybrid" else None,
        load_weight=load_weight if prefix else None,
        wall_s=round(time.perf_counter() - started, 1),
    )
    return row


def table(rows: list[dict[str, Any]], workload: str, replicas: list[int], labels: list[str]) -> str:
    head = " | ".join(
        f"{n} replicas: hit rate, of ideal, of one engine, imbalance, goodput per GPU-h"
        for n in replicas
    )
    lines = [f"| router | {head} |", "|---|" + "---|" * len(replicas)]
    by_key = {(r["workload"], r["replicas"], r["router"]): r for r in rows}
    for label in labels:
        cells = []
        for n in replicas:
            row, pooled = by_key[(workload, n, label)], by_key[(workload, n, "one engine")]
            of_pool = row["hit_rate"] / pooled["hit_rate"] if pooled["hit_rate"] else float("nan")
            cells.append(
                f"{row['hit_rate']:.4f}, {row['hit_rate_of_ideal']:.0%}, "
                f"{of_pool:.0%}, {row['imbalance']:.2f}, {row[GOODPUT[workload]]:,.1f}"
            )
        lines.append(f"| `{label}` | " + " | ".join(cells) + " |")
    for label, name in (("one engine, the fleet's pool", ONE_ENGINE[0]), (UNBOUNDED[0], None)):
        cells = [f"{by_key[(workload, n, name or label)]['hit_rate']:.4f}" for n in replicas]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="4,8")
    parser.add_argument("--workloads", default="mooncake,agents")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--limit", type=int, default=1200)
    parser.add_argument("--agents", type=int, default=40)
    parser.add_argument("--spec", default="eagle")
    parser.add_argument("--load-weights", default=f"{LOAD_WEIGHT:g},1.0")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    replicas = [int(n) for n in args.replicas.split(",")]
    try:
        load_weights = [float(w) for w in args.load_weights.split(",")]
    except ValueError:
        message = f"--load-weights: {args.load_weights!r}; use numbers, e.g. 0.1,1.0"
        raise SystemExit(message) from None
    fleet_rows = rows_of(load_weights)
    workloads = args.workloads.split(",")
    for workload in workloads:
        workload_config(workload, args)  # a bad name fails before any run
    tasks = [
        (w, n, label, router, weight, load_weight, args)
        for w in workloads
        for n in replicas
        for label, router, weight, load_weight in (
            *fleet_rows,
            (*ONE_ENGINE, 0, 0),
            (*UNBOUNDED, 0, 0),
        )
    ]
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = []
        for row in pool.map(_task, tasks):
            rows.append(row)
            print(json.dumps(row), flush=True)
    for workload in workloads:
        labels = [label for label, *_ in fleet_rows]
        print(f"\n{workload}\n\n{table(rows, workload, replicas, labels)}\n", flush=True)
    print(json.dumps({"rows": rows, "wall_s": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
