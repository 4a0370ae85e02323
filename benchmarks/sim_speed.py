"""Wall seconds to simulate one hour of the Mooncake conversation trace on a hybrid profile.

Prints one JSON object: the wall time, simulated seconds, steps, requests, and the share of time
in the scheduler, the executor (cost model) and the cache (with --profile, the top functions go
to stderr). Goal: under 60 s on one core.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time

from hybridserve.core.paths import data_path
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.run import simulate

TRACE = data_path("traces", "conversation_trace.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", action="store_true", help="cProfile; top 25 to stderr")
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
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    summary = simulate(config)
    if profiler is not None:
        profiler.disable()
    wall = time.perf_counter() - start
    out = {
        "benchmark": "sim_speed",
        "trace": TRACE.name,
        "model": args.model,
        "wall_s": round(wall, 2),
        "simulated_s": round(summary["simulated_s"], 1),
        "steps": int(summary["steps"]),
        "requests_completed": int(summary["requests_completed"]),
        "simulated_seconds_per_wall_second": round(summary["simulated_s"] / wall, 1),
        "goal": "wall_s < 60 for one simulated hour on one core",
    }
    print(json.dumps(out))
    if profiler is not None:
        stats = pstats.Stats(profiler, stream=sys.stderr)
        stats.sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
