"""Wall seconds to simulate one hour of the Mooncake conversation trace on a fleet.

Prints one JSON object: the wall time, simulated seconds, steps, requests, the fleet's hit rate
against its global ideal and its load imbalance. The default is the issue's benchmark: 8
replicas of Qwen3-Next (vLLM baseline preset) behind the prefix-hybrid router.
"""

from __future__ import annotations

import argparse
import json
import time

from hybridserve.core.paths import data_path
from hybridserve.sim.deployment import FleetConfig, SimConfig
from hybridserve.sim.run import run_fleet

TRACE = data_path("traces", "conversation_trace.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--router", default="prefix-hybrid")
    parser.add_argument("--router-view", default="precise")
    parser.add_argument("--limit", type=int, default=None, help="only the first N requests")
    parser.add_argument("--model", default="qwen3-next-80b-a3b")
    args = parser.parse_args()
    if not TRACE.exists():
        print(json.dumps({"error": f"{TRACE} is absent; restore data/ or set HYBRIDSERVE_DATA"}))
        return
    config = SimConfig(
        model=args.model,
        preset="baseline",
        workload=f"mooncake:{TRACE}",
        limit=args.limit,
        duration_s=3_600.0,
        warmup_s=0.0,
    )
    fleet = FleetConfig(replicas=args.replicas, router=args.router, view=args.router_view)
    start = time.perf_counter()
    done = run_fleet(config, fleet)
    wall = time.perf_counter() - start
    summary, report = done.run.summary, done.fleet
    print(
        json.dumps(
            {
                "benchmark": "fleet_speed",
                "trace": TRACE.name,
                "model": args.model,
                "replicas": args.replicas,
                "router": args.router,
                "router_view": args.router_view,
                "wall_s": round(wall, 2),
                "simulated_s": round(summary["simulated_s"], 1),
                "steps": int(summary["steps"]),
                "requests_completed": int(summary["requests_completed"]),
                "hit_rate": round(report["hit_rate"], 4),
                "global_ideal_hit_rate": round(report["global_ideal_hit_rate"], 4),
                "imbalance": round(report["imbalance"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
