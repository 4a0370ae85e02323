"""An Azure trace on real engines, and the simulator held to it: the open-loop kind of load of
the workload suite's trace rows (requests at the trace's arrival times, prompts that share
nothing), where `e1_real.py` and `fidelity.py` measure E1's agents.

For each time scale (`--time-scales`, wall seconds per trace second: 8 is an eighth of the
trace's rate) and seed, each server (`serve --executor torch` with `--preset baseline` and with
the shipped preset, vLLM-CPU; the order rotated by seed, as in `e1_real.py`) is started fresh
with the same KV pool, `hybridserve agents --url --workload azure:WINDOW` replays one window of
the trace against it, and the server is stopped. Seed k replays the k-th window: the trace's
requests from trace second k x S on, S = --duration / time scale, re-based to start at 0 and
written to `--log-dir` (`azure-WINDOW-tsX-sK.csv`), so every seed is another stretch of the
trace and every server of a seed gets the same requests.

Then each run is simulated on the same window, time scale, pool, block size and scheduler with
that server's calibration (`fidelity.py`'s three: `torch-own` and `torch-http` for our servers,
`vllm-http` for vLLM; `--calibrate` measures them after the runs, in the same hour, else they
are read from `--calibrations`), and the report has:

* `runs`: every run's load-generator metrics;
* `ratios`: per time scale, the paired ratios hybridserve/vllm, baseline/vllm and
  hybridserve/baseline of the SLO goodput (requests/s within the SLO), output tokens/s, TTFT
  and ITL p50/p99 and SLO attainment (geometric means of per-seed ratios, 95% t intervals);
* `rows`: fidelity rows as `fidelity.py` writes them (engine, calibration, load, metric,
  measured, simulated, error = simulated / measured - 1 of the means over the seeds, scored,
  per seed), `load` being `azure-conv x1/8`.

    python benchmarks/trace_real.py --time-scales 8 --seeds 3 --calibrate \\
        --vllm-python /tmp/vllm-venv/bin/python --out runs/trace_real.json
    python benchmarks/trace_real.py --report runs/trace_real.json --calibrations DIR  # re-score
    python benchmarks/trace_real.py --report runs/trace_real.json  # with the ones it carries

A CPU's step times drift over a long set (20-30% in two hours on the AMD host), so one
calibration prices the set's first and last runs alike. With `--calibrations-after DIR2`, a
second set of calibrations measured after the runs, each run's twin is simulated with both and
its metrics interpolated by when the run ran (its midpoint between the two calibrations'
midpoints, clamped to them): `--calibrate` records when it measured, in `measured.json`, and
every run records when it began and ended.

    python benchmarks/trace_real.py --report R --calibrations BEFORE --calibrations-after AFTER
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e1_real import (
    PAIRS,
    add_engine_options,
    prepare,
    rotated,
    serve_and_load,
    server_process,
    timed,
)
from fidelity import (
    CALIBRATION_SET,
    CALIBRATIONS,
    GOALS,
    MEASURED,
    add_sharing_options,
    bracketed,
    calibrate_set,
    compare_rows,
    markdown,
    measured_stamp,
    read_set,
    simulate_summary,
    twin_config,
    without_shared_kv,
)
from hf_checkpoint import hf_checkpoint

from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.stats import paired_ratio

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "data" / "traces" / "AzureLLMInferenceTrace_conv.csv"
METRICS = (
    "slo_requests_per_s",
    "output_tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "slo_attainment",
    "requests_completed",
)
CALIBRATION_NAMES = CALIBRATION_SET


# ----- the trace's windows ----------------------------------------------------------------------


def _stamp(text: str) -> datetime:
    return datetime.fromisoformat(text[:26])


def trace_window(trace: Path, start_s: float, span_s: float) -> list[dict[str, str]]:
    """The trace's rows whose arrival is in [start_s, start_s + span_s) seconds after its first
    request, in order. Raises SystemExit naming the trace when it has none there."""
    with trace.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        raise SystemExit(f"--trace {trace}: no requests")
    first = _stamp(rows[0]["TIMESTAMP"])
    kept = [
        row
        for row in rows
        if start_s <= (_stamp(row["TIMESTAMP"]) - first).total_seconds() < start_s + span_s
    ]
    if not kept:
        raise SystemExit(
            f"--trace {trace}: no request between {start_s:.1f} and {start_s + span_s:.1f} s "
            "after its first; use fewer seeds or a larger --time-scales"
        )
    return kept


def window_path(log_dir: Path, trace: Path, time_scale: float, seed: int) -> Path:
    return log_dir / f"{trace.stem}-ts{time_scale:g}-s{seed}.csv"


def write_window(
    trace: Path, time_scale: float, seed: int, duration_s: float, log_dir: Path
) -> Path:
    """Seed `seed`'s window of the trace (trace seconds [seed x S, (seed + 1) x S), S = the
    run's duration over the time scale), written as an Azure CSV the load generator and the
    simulator both replay from its first request on."""
    span = duration_s / time_scale
    rows = trace_window(trace, seed * span, span)
    path = window_path(log_dir, trace, time_scale, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def ensure_windows(report: dict[str, Any], log_dir: Path) -> None:
    """Write again, into `log_dir`, the windows of the report's runs that are not on disk (a
    report from another machine or a clean checkout): they follow from the trace, the time
    scale, the seed and the duration alone."""
    setup = report["setup"]
    trace = Path(setup["trace"])
    if not trace.is_absolute() and not trace.is_file():
        trace = ROOT / trace
    for run in report["runs"]:
        if "window" in run and not Path(run["window"]).is_file():
            path = write_window(trace, run["time_scale"], run["seed"], setup["duration"], log_dir)
            run["window"] = str(path)


def load_label(trace: Path, time_scale: float) -> str:
    name = trace.stem.removeprefix("AzureLLMInferenceTrace_")
    return f"azure-{name} x1/{time_scale:g}"


# ----- real runs --------------------------------------------------------------------------------


def agents_command(
    args: argparse.Namespace, url: str, window: Path, time_scale: float, seed: int, out: Path
) -> list[str]:
    return [
        sys.executable, "-c", "from hybridserve.cli import main; main()", "agents",
        "--url", url, "--model", args.model, "--workload", f"azure:{window}",
        "--time-scale", f"{time_scale:g}", "--duration", str(args.duration),
        "--warmup", str(args.warmup), "--seed", str(seed), "--out", str(out), "--json",
    ]  # fmt: skip


def one_run(
    args: argparse.Namespace, name: str, time_scale: float, seed: int, window: Path
) -> dict[str, Any]:
    """Start `name` fresh, replay the window against it, read its counters, stop it."""
    tag = f"ts{time_scale:g}"
    server = server_process(args, name, tag, seed)  # type: ignore[arg-type]
    entry: dict[str, Any] = {
        "server": name, "time_scale": time_scale, "seed": seed, "window": str(window)
    }  # fmt: skip
    out = args.log_dir / f"{name}-{tag}-s{seed}"
    serve_and_load(
        args, server, entry, lambda url: agents_command(args, url, window, time_scale, seed, out)
    )
    return entry


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    total = len(args.time_scales) * len(seeds) * len(args.servers)
    for time_scale in args.time_scales:
        for seed in seeds:
            window = write_window(args.trace, time_scale, seed, args.duration, args.log_dir)
            for name in rotated(args.servers, seed):
                print(
                    f"run {len(runs) + 1}/{total}: {name}, time scale {time_scale:g}, seed {seed}",
                    file=sys.stderr,
                    flush=True,
                )
                runs.append(entry := timed(one_run, args, name, time_scale, seed, window))
                metrics = entry.get("metrics", {})
                print(
                    f"  done {metrics.get('requests_completed')}, tok/s "
                    f"{metrics.get('output_tokens_per_s')}, ITL p50 {metrics.get('itl_p50_ms')}"
                    f", TTFT p99 {metrics.get('ttft_p99_ms')}",
                    file=sys.stderr,
                    flush=True,
                )
    return runs


# ----- the report -------------------------------------------------------------------------------


def finished(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if "failed" not in r and "error" not in r.get("metrics", {"error": 1})]


def per_seed(
    runs: list[dict[str, Any]], server: str, time_scale: float, seeds: list[int], key: str
) -> list[float | None]:
    found = {
        r["seed"]: r["metrics"].get(key)
        for r in finished(runs)
        if r["server"] == server and r["time_scale"] == time_scale
    }
    return [found.get(seed) for seed in seeds]


def ratios(runs: list[dict[str, Any]], time_scale: float, seeds: list[int]) -> dict[str, Any]:
    """Per pair of servers that ran, per metric: the paired ratio and both sides' values."""
    servers = {r["server"] for r in runs}
    out: dict[str, Any] = {}
    for ours, base in PAIRS:
        if {ours, base} <= servers:
            out[f"{ours}/{base}"] = {}
            for key in METRICS:
                mine = per_seed(runs, ours, time_scale, seeds, key)
                theirs = per_seed(runs, base, time_scale, seeds, key)
                ratio = paired_ratio(mine, theirs)
                out[f"{ours}/{base}"][key] = {**ratio, ours: mine, base: theirs}
    return out


def sim_config(
    setup: dict[str, Any],
    pool: dict[str, Any],
    run: dict[str, Any],
    calibration: Path,
    checkpoint: Path,
) -> SimConfig:
    """The simulated twin of one real run (fidelity.py's `twin_config`): its window replayed at
    its time scale."""
    return twin_config(
        setup,
        pool,
        run["server"],
        run["seed"],
        calibration,
        checkpoint,
        workload=f"azure:{run['window']}",
        time_scale=run["time_scale"],
    )


def calibration_folder(
    report: dict[str, Any], folder: Path, key: str = "calibrations", option: str = "--calibrations"
) -> Path:
    """`folder` when it holds every calibration; else, for a report that carries them all under
    `key` (an earlier `--out`), those, written to a temporary folder with when they were
    measured: a report scores again as it was scored, from a clean checkout. Exits naming the
    missing files otherwise."""
    missing = [n for n in CALIBRATION_NAMES if not (folder / f"{n}.json").is_file()]
    if not missing:
        return folder
    carried = report.get(key) or {}
    if all(name in carried for name in CALIBRATION_NAMES):
        written = Path(tempfile.mkdtemp(prefix="trace-real-calibrations-"))
        for name in CALIBRATION_NAMES:
            (written / f"{name}.json").write_text(json.dumps(carried[name]))
        stamp = (report.get("calibrations_measured") or {}).get(key)
        if stamp is not None:
            (written / MEASURED).write_text(json.dumps(stamp))
        print(f"{option} {folder}: none there; the report's own", file=sys.stderr)
        return written
    raise SystemExit(f"{option} {folder}: no {', '.join(missing)}")


def simulate_all(
    report: dict[str, Any], calibrations: Path, *, shared_kv: bool = True
) -> dict[tuple[str, str, float, int], dict[str, float]]:
    """(server, calibration, time scale, seed) -> the twin's summary, for every finished run;
    `shared_kv` False: each calibration's shared-prefix term left out."""
    out: dict[tuple[str, str, float, int], dict[str, float]] = {}
    setup, pool = report["setup"], report["pool"]
    checkpoint = hf_checkpoint(setup["model"])
    for run in finished(report["runs"]):
        for name in CALIBRATIONS[run["server"]]:
            path = calibrations / f"{name}.json"
            config = sim_config(setup, pool, run, path, checkpoint)
            if not shared_kv:
                config = without_shared_kv(config)
            out[(run["server"], name, run["time_scale"], run["seed"])] = simulate_summary(config)
    return out


def fidelity_rows(
    report: dict[str, Any], simulated: dict[tuple[str, str, float, int], dict[str, float]]
) -> list[dict[str, Any]]:
    """One row per server, calibration, time scale and metric: means over the seeds."""
    measured = {
        (r["server"], r["time_scale"], r["seed"]): r["metrics"] for r in finished(report["runs"])
    }
    trace = Path(report["setup"]["trace"])
    return compare_rows(measured, simulated, METRICS, lambda scale: load_label(trace, scale))


# The error table's columns: the metrics with a goal.
TABLE_METRICS = tuple(m for m in METRICS if m in GOALS)


def summarise(
    setup: dict[str, Any], pool: dict[str, Any], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    scales = sorted({r["time_scale"] for r in runs})
    seeds = {t: sorted({r["seed"] for r in runs if r["time_scale"] == t}) for t in scales}
    return {
        "setup": setup | {"seeds": {f"{t:g}": seeds[t] for t in scales}},
        "pool": pool,
        "runs": runs,
        "ratios": {f"{t:g}": ratios(runs, t, seeds[t]) for t in scales},
        "failed_runs": [
            {k: r[k] for k in ("server", "time_scale", "seed")} | {"reason": r["failed"]["reason"]}
            for r in runs
            if "failed" in r
        ],
    }


# ----- command line -----------------------------------------------------------------------------


def _scales(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give time scales > 0, e.g. 8 or 6,12")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--trace", type=Path, default=TRACE, help="an Azure trace CSV")
    add("--time-scales", type=_scales, default=[8.0], help="wall seconds per trace second")
    add("--seeds", type=int, default=3, help="windows of the trace, from --first-seed")
    add("--first-seed", type=int, default=0)
    add("--model", default="smollm2", choices=("smollm2", "gemma3-270m"))
    add_engine_options(add)
    add("--start-timeout", type=float, default=600.0)
    add("--log-dir", type=Path, default=ROOT / "runs" / "trace_real_logs")
    add("--calibrations", type=Path, default=ROOT / "runs" / "fidelity", help="calibration folder")
    add("--calibrate", action="store_true", help="measure the calibrations after the runs")
    add(
        "--calibrations-after",
        type=Path,
        default=None,
        help="calibrations measured after the runs: each twin interpolated between the two",
    )
    add_sharing_options(add)
    add("--no-simulate", action="store_true", help="the real runs only")
    add("--report", type=Path, default=None, help="score an earlier report instead of running")
    add("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.first_seed < 0:
        parser.error(f"--seeds {args.seeds} --first-seed {args.first_seed}: use 1+ and 0+")
    if not args.duration > args.warmup >= 0:
        parser.error(f"--duration {args.duration} must exceed --warmup {args.warmup} >= 0")
    if args.report is None and not args.trace.is_file():
        parser.error(f"--trace {args.trace}: no such file; give an Azure trace CSV")
    return args


def real_runs(args: argparse.Namespace) -> dict[str, Any]:
    # e1_real.prepare reads the agent options too; a trace run has none of them.
    args.quick, args.merge, args.agents = False, [], []
    setup = prepare(args)
    for key in ("agents", "time_scales", "no_simulate", "report", "calibrate", "calibrations"):
        setup.pop(key, None)
    setup["trace"] = str(args.trace)
    setup["time_scales"] = args.time_scales
    began = time.monotonic()
    report = summarise(setup, args.pool, run_all(args))
    report["wall_s"] = round(time.monotonic() - began, 1)
    return report


def calibrate_all(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Measure the three calibrations into --calibrations, and when (`measured.json`)."""
    args.setup = report["setup"]
    calibrate_set(args, hf_checkpoint(report["setup"]["model"]))


def score(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """The report's fidelity rows, with --calibrations (or the report's own), bracketed by
    --calibrations-after when given (or by the report's own after-calibrations, when it is
    scored with its own and carries both)."""
    folder = calibration_folder(report, args.calibrations)
    after = args.calibrations_after
    if after is None and folder != args.calibrations and "calibrations_after" in report:
        after = calibration_folder(
            report, args.calibrations, "calibrations_after", "--calibrations-after"
        )
    if after is not None:  # its times read before any simulation
        stamps = (measured_stamp(folder), measured_stamp(after))
        after = calibration_folder({}, after, option="--calibrations-after")
    shared_kv = not args.without_shared_kv
    report["shared_kv_left_out"] = not shared_kv
    simulated = simulate_all(report, folder, shared_kv=shared_kv)
    if after is not None:
        after_runs = simulate_all(report, after, shared_kv=shared_kv)
        simulated = bracketed(report["runs"], "time_scale", stamps, simulated, after_runs)
        report["calibrations_after"] = read_set(after)
        report["calibrations_measured"] = {
            "calibrations": stamps[0],
            "calibrations_after": stamps[1],
        }
    report["rows"] = fidelity_rows(report, simulated)
    report["calibrations"] = read_set(folder)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = json.loads(args.report.read_text()) if args.report is not None else real_runs(args)
    ensure_windows(report, args.log_dir)
    if not args.no_simulate:
        if args.calibrate:
            calibrate_all(args, report)
        score(args, report)
        print(markdown(report["rows"], TABLE_METRICS), file=sys.stderr)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
