"""The full workload suite: every row of `hybridserve suite` in its full form (30-40 minute
agent runs, 1,500-request traces at 1x and 6,000 at 4x, 15-minute fixed loads) on paired seeds,
for the presets given. Prints one JSON object (the suite's report) and writes it to --out.

The screen (`hybridserve suite`, 2 seeds, shorter runs) takes under 10 minutes on a 2-core
machine; the full suite with 5 seeds takes hours there: run it on a larger machine, with
--workers set to its cores.

    python benchmarks/suite.py --seeds 5 --workers 16 --presets hybridserve,adaptive \
        --out runs/suite_full.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.suite import (
    TUNED,
    count_runs,
    pick_rows,
    run_suite,
    suite_configs,
    suite_report,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="all", help="all, choose, report or names")
    parser.add_argument("--presets", default="hybridserve")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tuned", type=Path, default=TUNED)
    parser.add_argument("--screen", action="store_true", help="the screen's shorter runs")
    parser.add_argument("--out", type=Path, default=Path("runs/suite_full.json"))
    args = parser.parse_args()
    rows = pick_rows(args.rows)
    names = [p for p in args.presets.split(",") if p]
    bound = any(row.bounded for row in rows)
    configs, search = suite_configs(SimConfig(), names, args.tuned, bound=bound)
    seeds = list(range(args.seeds))
    mode = "screen" if args.screen else "full"
    started = time.monotonic()
    total = count_runs(rows, list(configs), seeds)

    def log(line: str) -> None:
        sys.stderr.write(f"[{time.monotonic() - started:7.0f} s] {line} (of {total})\n")

    results, errors = run_suite(rows, configs, seeds, mode=mode, workers=args.workers, log=log)
    report = suite_report(rows, configs, seeds, results, errors, mode=mode, search=search)
    report["suite"]["wall_s"] = round(time.monotonic() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    sys.stdout.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
