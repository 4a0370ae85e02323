"""Where the pool suffices, the host tier must cost nothing: the shipped preset with and without
a host tier on loads whose contexts fit the device, paired seeds. Prints one JSON object (and
writes it with --out): per row, the paired ratio (tier / no tier) of SLO job goodput (agent
rows) or SLO request goodput (trace rows), output tokens/s and p99 ITL, with 95% intervals.

    python benchmarks/host_tier_regression.py --seeds 3 --host-memory-gib 256 --workers 2 \\
        --out docs/host_tier_regression.json

`--rows suite` (or `suite:SPEC`, SPEC as `hybridserve suite --rows` takes it) runs the workload
suite's rows at its screen settings instead (docs/suite.md), each with and without the tier.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.experiment import run_configs
from hybridserve.sim.stats import mean_ci95, paired_ratio
from hybridserve.sim.suite import pick_rows
from hybridserve.sim.workload import AgentParams

# name -> SimConfig fields: agents at 20 and 40 (the pool holds their contexts) and the
# Mooncake conversation trace at its own rate.
ROWS: dict[str, dict[str, Any]] = {
    "agents-20": {"agents": AgentParams(num_agents=20), "duration_s": 600.0, "warmup_s": 120.0},
    "agents-40": {"agents": AgentParams(num_agents=40), "duration_s": 600.0, "warmup_s": 120.0},
    "mooncake-1x": {
        "workload": "mooncake:data/traces/conversation_trace.jsonl",
        "limit": 1000,
        "duration_s": 1e9,
        "warmup_s": 0.0,
    },
}
KEYS = ("slo_jobs_per_hour", "slo_requests_per_s", "output_tokens_per_s", "itl_p99_ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--host-memory-gib", type=float, default=256.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.seeds < 2:
        parser.error("--seeds: a paired interval needs at least 2 seeds")
    started = time.perf_counter()
    configs: dict[str, SimConfig] = {}
    if args.rows == "suite" or args.rows.startswith("suite:"):
        spec = args.rows.partition(":")[2] or "all"
        bases = {row.name: row.config(SimConfig(), "screen") for row in pick_rows(spec)}
    else:
        unknown = [n for n in args.rows.split(",") if n.strip() and n.strip() not in ROWS]
        if unknown:
            parser.error(f"--rows: unknown {unknown}; use {list(ROWS)}, suite or suite:SPEC")
        bases = {n.strip(): SimConfig(**ROWS[n.strip()]) for n in args.rows.split(",") if n.strip()}
    names = list(bases)
    for name, base in bases.items():
        configs[f"{name}/off"] = base
        configs[f"{name}/tier"] = replace(base, host_memory_gib=args.host_memory_gib)
    results, _ = run_configs(configs, list(range(args.seeds)), workers=args.workers)
    rows = {}
    for name in names:
        off, tier = results[f"{name}/off"], results[f"{name}/tier"]
        rows[name] = {
            "ratios": {k: paired_ratio([r[k] for r in tier], [r[k] for r in off]) for k in KEYS},
            "off": {k: mean_ci95([r[k] for r in off])[0] for k in KEYS},
            "tier": {k: mean_ci95([r[k] for r in tier])[0] for k in KEYS},
            "host_loaded_per_seed": [r.get("host_loaded", 0.0) for r in tier],
        }
    out = {
        "rows_spec": args.rows,
        "host_memory_gib": args.host_memory_gib,
        "seeds": args.seeds,
        "rows": rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
