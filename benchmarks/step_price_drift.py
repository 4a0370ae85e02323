"""Step prices over a set of real runs: every run's own steps priced by each calibration given,
and how the price moves with the hour the run ran (docs/fidelity.md).

A calibration is measured in minutes; a set of real runs takes an hour or two, and a CPU's step
times move over that (the AMD host's by 20-30% in two hours). `step_log_check.py` prices one
run's steps; this prices every run of an `e1_real.py` or `trace_real.py` report whose server
wrote a step log (our servers: `NAME-atsX-sS.steps.jsonl` or `NAME-aN-sS.steps.jsonl` in the
report's log folder or `--log-dir`) with each `--calibration`, on the steps' own shapes, and
prints per run:

* when it ran: the midpoint of its `began` and `ended` (trace_real.py records them), else the
  step log's last change (the run's end), in hours after the set's first run;
* per calibration the ratio of sums, predicted / measured seconds, over all its steps, its
  decode-only steps and its mixed ones. 1.0 is a calibration that prices the run exactly; a
  ratio that falls over the set is a host that slowed down after it was measured;

and per calibration the least-squares line of the all-steps ratio against the hour (`drift`:
its value at the first run, its slope an hour, the largest and smallest ratio). No run is
simulated: only the cost model prices the real steps.

    python benchmarks/step_price_drift.py --report R.json --calibration BEFORE/torch-own.json \\
        --calibration AFTER/torch-own.json [--log-dir DIR] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_checkpoint import hf_checkpoint
from step_log_check import per_step, twin_config

from hybridserve.core.errors import ConfigError
from hybridserve.engine.step_log import read_step_log
from hybridserve.sim.run import simulated_cost_model

LOGGED = ("baseline", "hybridserve")  # the servers that write step logs
KINDS = ("all", "decode", "mixed")


def run_name(report: dict[str, Any], run: dict[str, Any]) -> tuple[float, str]:
    """(the run's load, its step log's file name)."""
    if "trace" in report["setup"]:
        load = float(run["time_scale"])
        return load, f"{run['server']}-ats{load:g}-s{run['seed']}.steps.jsonl"
    load = float(run["agents"])
    return load, f"{run['server']}-a{int(load)}-s{run['seed']}.steps.jsonl"


def ran_at(run: dict[str, Any], log: Path) -> tuple[float, str]:
    """(when the run ran as a POSIX time, where that came from)."""
    if "began" in run and "ended" in run:
        began = datetime.fromisoformat(run["began"]).timestamp()
        return (began + datetime.fromisoformat(run["ended"]).timestamp()) / 2, "run"
    return log.stat().st_mtime, "step log"


def price_runs(
    report: dict[str, Any], calibrations: list[Path], log_dir: Path, checkpoint: Path
) -> list[dict[str, Any]]:
    """One row per logged run: when it ran and each calibration's ratio of sums by kind."""
    rows = []
    for run in report["runs"]:
        if run.get("server") not in LOGGED or "failed" in run:
            continue
        load, name = run_name(report, run)
        log = log_dir / name
        try:
            records = read_step_log(log)
        except ConfigError as exc:
            raise SystemExit(f"--log-dir: {exc} (give the folder of the runs' step logs)") from None
        at, source = ran_at(run, log)
        row: dict[str, Any] = {
            "server": run["server"], "load": load, "seed": run["seed"], "steps": len(records),
            "at": at, "time_from": source, "ratio_of_sums": {},
        }  # fmt: skip
        for cal in calibrations:
            model = simulated_cost_model(
                twin_config(report, checkpoint, run["server"], load, run["seed"], cal)
            )
            priced = per_step(records, model)
            row["ratio_of_sums"][str(cal)] = {
                kind: priced[kind]["ratio_of_sums"] for kind in KINDS if kind in priced
            }
        rows.append(row)
    return rows


def drift(rows: list[dict[str, Any]], calibration: str) -> dict[str, Any]:
    """The all-steps ratio of `calibration` against the hour: its line's value at the first run
    and slope an hour (least squares), and its range."""
    points = [(row["hours"], row["ratio_of_sums"][calibration]["all"]) for row in rows]
    ratios = [r for _, r in points]
    out: dict[str, Any] = {"runs": len(points), "min": min(ratios), "max": max(ratios)}
    hours = [h for h, _ in points]
    if len(points) >= 2 and max(hours) > min(hours):
        slope, intercept = statistics.linear_regression(hours, ratios)
        out |= {"at_first_run": round(intercept, 4), "per_hour": round(slope, 4)}
    return out


def summarise(report_path: Path, rows: list[dict[str, Any]], calibrations: list[Path]) -> Any:
    first = min(row["at"] for row in rows)
    for row in rows:
        row["hours"] = round((row["at"] - first) / 3600.0, 3)
    rows.sort(key=lambda row: row["at"])
    return {
        "report": str(report_path),
        "first_run": datetime.fromtimestamp(first).astimezone().isoformat(timespec="seconds"),
        "calibrations": [str(c) for c in calibrations],
        "runs": rows,
        "drift": {str(c): drift(rows, str(c)) for c in calibrations},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--report", type=Path, required=True, help="an e1_real.py or trace_real.py report")
    add("--calibration", type=Path, action="append", required=True, help="repeat for several")
    add("--log-dir", type=Path, default=None, help="default: the report's own log folder")
    add("--out", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = json.loads(args.report.read_text())
    missing = [str(c) for c in args.calibration if not c.is_file()]
    if missing:
        raise SystemExit(f"--calibration {', '.join(missing)}: no such file")
    log_dir = args.log_dir or Path(report["setup"]["log_dir"])
    checkpoint = hf_checkpoint(report["setup"]["model"])
    rows = price_runs(report, args.calibration, log_dir, checkpoint)
    if not rows:
        raise SystemExit(f"--report {args.report}: no run of {LOGGED} with a step log")
    out = summarise(args.report, rows, args.calibration)
    for cal, line in out["drift"].items():
        print(f"{cal}: {json.dumps(line)}", file=sys.stderr)
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
