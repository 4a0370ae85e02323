"""Which control of the shipped preset makes a real E1 result: the simulated twins of an
`e1_real.py` report's runs (fidelity.py's: same workload, seed, pool and blocks, one
calibration), for `baseline`, the preset, and the preset without each of its controls.

    python benchmarks/e1_real_ablation.py --report R.json --calibration CAL/torch-own.json \\
        [--out F]

Prints a table on stderr and one JSON object on its last line: per variant, the mean over the
report's seeds of each metric, and per seed. Simulations are deterministic: the same report and
calibration give the same numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity import sim_config, simulate_summary
from hf_checkpoint import hf_checkpoint

# name -> (the report's server whose twin it is, scheduler overrides on top of its preset)
VARIANTS: dict[str, tuple[str, tuple[tuple[str, Any], ...]]] = {
    "baseline": ("baseline", ()),
    "hybridserve": ("hybridserve", ()),
    "without the waiting deadline": ("hybridserve", (("waiting_deadline_ms", 0.0),)),
    "without pins": ("hybridserve", (("kv_pin_fraction", 0.0), ("kv_pin_exact_tail", False))),
    "without the adaptive budget": (
        "hybridserve",
        (
            ("adaptive_budget_context_weight", False),
            ("adaptive_budget_calm_itl_ms", 0.0),
            ("adaptive_budget_pressure_itl_ms", 0.0),
            ("adaptive_budget_queue_ms", 0.0),
            ("adaptive_budget_itl_ms", 0.0),
        ),
    ),
}
METRICS = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "output_tokens_per_s",
    "prefix_hit_rate",
    "slo_attainment",
)


def jobs(report: dict[str, Any], calibration: Path, checkpoint: Path) -> list[tuple[str, int, Any]]:
    """(variant, seed, SimConfig) for every variant at every (load, seed) the report ran."""
    runs = {(r["agents"], r["seed"]) for r in report["runs"] if "metrics" in r}
    out = []
    for name, (server, overrides) in VARIANTS.items():
        for load, seed in sorted(runs):
            config = sim_config(report, checkpoint, server, load, seed, calibration)
            out.append((name, seed, replace(config, overrides=(*config.overrides, *overrides))))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--calibration", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text())
    todo = jobs(report, args.calibration, hf_checkpoint(report["setup"]["model"]))
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        summaries = list(pool.map(simulate_summary, [config for _, _, config in todo]))
    done = [
        (name, seed, {m: float(s[m]) for m in METRICS if s.get(m) is not None})
        for (name, seed, _), s in zip(todo, summaries, strict=True)
    ]
    result: dict[str, Any] = {"report": str(args.report), "calibration": str(args.calibration)}
    for name in VARIANTS:
        rows = {seed: metrics for n, seed, metrics in done if n == name}
        mean = {m: round(statistics.fmean(r[m] for r in rows.values()), 2) for m in METRICS}
        result[name] = {"mean": mean, "per_seed": rows}
        print(f"{name:30} " + "  ".join(f"{m} {v:g}" for m, v in mean.items()), file=sys.stderr)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
