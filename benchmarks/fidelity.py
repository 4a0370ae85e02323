"""The simulator against real engines: every run of an `e1_real.py` report simulated on the
same workload, seed, pool and block size with that server's calibration, and the two compared
per engine, load and metric (docs/fidelity.md, docs/fidelity.json).

Calibrations (`--calibrate` measures them first, on idle cores; else they are read from
`--calibrations`):

- `torch-own`: `hybridserve calibrate --model CHECKPOINT --gpu-name cpu` (the torch executor's
  step times, measured in-process, peaks from microbenchmarks);
- `torch-http`: `hybridserve calibrate --url` against `serve --executor torch --preset
  baseline` (black-box: the gaps between streamed tokens, so the server's per-step work is
  in them), peaks from `torch-own`;
- `vllm-http`: the same against vLLM-CPU.

Each also times its decode batches again with half of every context in the same blocks and fits
the cost model's shared-prefix term on them (`--decode-shared-fraction`, 0.5; 0 measures none):
E1's decodes all read one system prompt. `--without-shared-kv` scores the twins without it.

The torch servers (baseline, hybridserve) are simulated with both torch calibrations, vLLM
with its own. The simulated scheduler is the server's: `baseline` for baseline and for vLLM,
`hybridserve` for the shipped preset. No E1 run is used to fit anything (the calibrations
measure controlled shapes only), so every row is scored.

A device's step times move over a set of runs (20-30% in two hours on the AMD host): with
`--calibrations-after DIR2`, a second set measured after the runs, every twin is simulated with
both and its metrics interpolated by the hour its run ran (e1_real.py records each run's
`began` and `ended`, `--calibrate` each set's `measured.json`).

Each row: `{"engine", "calibration", "load", "metric", "measured", "simulated", "error",
"scored", "per_seed"}`, `error = simulated / measured - 1` of the means over the seeds both
sides have.

    python benchmarks/e1_real.py ... --out runs/e1_real/e1_real_smollm2.json
    python benchmarks/fidelity.py --report runs/e1_real/e1_real_smollm2.json --calibrate \\
        --vllm-python /tmp/vllm-venv/bin/python --out docs/fidelity.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agents_vs_sim import METRICS
from hf_checkpoint import hf_checkpoint
from server_process import ServerFailed, ServerProcess, free_port

from hybridserve.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from hybridserve.loadgen.calibrate import RemoteTarget, calibrate_remote, model_profile_for
from hybridserve.sim.calibration import Calibration
from hybridserve.sim.calibration_fit import Grid, with_sharing
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.run import run_simulation
from hybridserve.sim.workload import AgentParams

ROOT = Path(__file__).resolve().parents[1]
CALIBRATIONS = {
    "baseline": ("torch-own", "torch-http"),
    "hybridserve": ("torch-own", "torch-http"),
    "vllm": ("vllm-http",),
}
PRESETS = {"baseline": "baseline", "hybridserve": "hybridserve", "vllm": "baseline"}
# Goals of the comparison (docs/fidelity.md): |error| within these per metric.
GOALS = {
    "job_goodput_per_hour": 0.10,
    "slo_requests_per_s": 0.10,  # a trace's goodput (trace_real.py), as the jobs'
    "output_tokens_per_s": 0.10,
    "ttft_p50_ms": 0.15,
    "itl_p50_ms": 0.15,
    "ttft_p99_ms": 0.25,
    "itl_p99_ms": 0.25,
}
CALIBRATION_POOL_BLOCKS = 2048  # the calibration servers' pool: 8 streams of 2k tokens fit
# calibrate --url's shapes sized for a 2-core CPU (the quick grid's 16 streams of 8k tokens
# would take an hour to prefill there): prefills of 256 and 1,024 tokens after 0 and 2,048
# cached ones, 1, 4 and 8 decodes at 256, 1,024 and 2,048 tokens (three batches at three
# contexts, so the KV read rate is fitted apart from the weights'), two interleaved rounds.
CPU_GRID = Grid(
    prefill_tokens=(256, 1024),
    prefill_context_tokens=(0, 2048),
    decode_batches=(1, 4, 8),
    decode_context_tokens=(256, 1024, 2048),
    rounds=2,
    repeats=1,
)


def _cli() -> list[str]:
    return [sys.executable, "-c", "from hybridserve.cli import main; main()"]


def _env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def calibrate_own(args: argparse.Namespace, checkpoint: Path) -> None:
    out = args.calibrations / "torch-own.json"
    command = [*_cli(), "calibrate", "--model", str(checkpoint), "--gpu-name", "cpu"]
    command += ["--threads", str(args.threads), "--out", str(out)]
    command += ["--decode-shared-fraction", str(args.decode_shared_fraction)]
    print(f"calibrating the torch executor: {out}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True, env={**os.environ, **_env()})


def calibration_server(args: argparse.Namespace, name: str, checkpoint: Path) -> ServerProcess:
    port, setup = free_port(), args.setup
    log = args.calibrations / f"{name}-server.log"
    common = ["--served-model-name", setup["model"], "--port", str(port)]
    common += [
        "--block-size",
        str(setup["block_size"]),
        "--max-model-len",
        str(setup["max_model_len"]),
    ]
    if name == "torch-http":
        command = [*_cli(), "serve", "--executor", "torch", "--model", str(checkpoint)]
        command += ["--device", "cpu", "--threads", str(args.threads), "--preset", "baseline"]
        command += ["--num-blocks", str(CALIBRATION_POOL_BLOCKS), "--shutdown-timeout", "5"]
        # vLLM's budget, as vLLM below is given (on a CPU `serve` would otherwise take 2,048)
        command += ["--max-num-batched-tokens", str(DEFAULT_MAX_NUM_BATCHED_TOKENS)]
        return ServerProcess(name, command + common, log, port, env=_env())
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", str(checkpoint), "--host", "127.0.0.1", "--dtype", "float32"]
    command += ["--max-num-seqs", str(DEFAULT_MAX_NUM_SEQS)]
    command += ["--max-num-batched-tokens", str(DEFAULT_MAX_NUM_BATCHED_TOKENS)]
    command += ["--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "OMP_NUM_THREADS": str(args.threads)}
    env |= {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_USE_AOT_COMPILE": "0"}
    return ServerProcess(name, command + common, log, port, env=env)


def calibrate_http(args: argparse.Namespace, name: str, checkpoint: Path) -> None:
    """Start the server, calibrate it over HTTP on CPU_GRID with the torch executor's peaks,
    write the calibration, stop the server."""
    out = args.calibrations / f"{name}.json"
    server = calibration_server(args, name, checkpoint)
    print(f"calibrating {name} over HTTP: {out}", file=sys.stderr, flush=True)
    own = Calibration.load(args.calibrations / "torch-own.json")
    try:
        server.start(600.0)
        target = RemoteTarget(
            url=server.base_url, model=args.setup["model"], api_key=None, gpu=own.gpu,
            peaks=own.peaks, profile=model_profile_for(checkpoint, None), dtype="fp32",
            kv_dtype="fp32",
        )  # fmt: skip
        grid = with_sharing(CPU_GRID, args.decode_shared_fraction)
        result = asyncio.run(calibrate_remote(target, grid=grid, progress=_progress(name)))
    except ServerFailed as exc:
        raise SystemExit(
            f"{name}: the server did not start ({exc.reason}):\n{exc.log_tail}"
        ) from None
    finally:
        server.stop()
    out.write_text(json.dumps(result.to_json(), indent=2) + "\n")


def _progress(name: str) -> Callable[[int, int], None]:
    def say(done: int, total: int) -> None:
        print(f"  {name}: {done}/{total} measurements", file=sys.stderr, flush=True)

    return say


def agent_params(setup: dict[str, Any], load: int) -> AgentParams:
    """The load generator's workload (`hybridserve agents` with the report's options), its tool
    times scaled by --time-scale as the load generator scales its waits."""
    params = AgentParams(
        num_agents=load,
        system_prompt_tokens=setup["system_prompt_tokens"],
        context_limit=setup["max_context"],
    ).with_medians(
        output_tokens=setup["output_tokens"], tool_result_tokens=setup["tool_result_tokens"]
    )
    return params.with_tool_times_scaled(setup["time_scale"])


def twin_config(
    setup: dict[str, Any],
    pool: dict[str, Any],
    engine: str,
    seed: int,
    calibration: Path,
    checkpoint: Path,
    **workload: Any,
) -> SimConfig:
    """The simulated twin of one real run of `engine`: the same model, seed, duration and pool
    in the same blocks, the server's scheduler, `calibration`'s device and constants; the load
    (`workload`: agents or a trace window, and what goes with it) given by the caller."""
    cal = Calibration.load(calibration)
    return SimConfig(
        model=setup["model"],
        model_config=str(checkpoint / "config.json"),
        gpu=cal.device,
        calibrated_gpu=cal.gpu,
        efficiency=cal.efficiency,
        dtype=cal.dtype,
        kv_dtype=cal.kv_dtype,
        preset=PRESETS[engine],
        speculation="none",
        duration_s=setup["duration"],
        warmup_s=setup["warmup"],
        seed=seed,
        max_model_len=setup["max_model_len"],
        block_size=pool["block_size"],
        num_gpu_blocks_override=pool["num_blocks"],
        **workload,
    )


def sim_config(
    report: dict[str, Any],
    checkpoint: Path,
    engine: str,
    load: int,
    seed: int,
    calibration: Path,
    *,
    before_context_weight: bool = False,
) -> SimConfig:
    """The simulated twin of one real run: same workload and seed, same pool in the same blocks.
    `before_context_weight`: the shipped preset's runs were served before its context weight,
    so their twins run without it."""
    setup, pool = report["setup"], report["pool"]
    overrides: tuple[tuple[str, Any], ...] = ()
    if before_context_weight and PRESETS[engine] == "hybridserve":
        overrides = (("adaptive_budget_context_weight", False),)
    return twin_config(
        setup,
        pool,
        engine,
        seed,
        calibration,
        checkpoint,
        overrides=overrides,
        agents=agent_params(setup, load),
        # The load generator's: drawn answers (no turn reuses its answer's KV), or with
        # `--answers server` the server's own tokens, as the simulated engine's are.
        answers="engine" if setup.get("answers") == "server" else "synthetic",
    )


def without_shared_kv(config: SimConfig) -> SimConfig:
    """`config` with its calibration's shared-prefix term (`Efficiency.shared_kv`) at 0."""
    return replace(config, efficiency=replace(config.efficiency, shared_kv=0.0))


def simulate_summary(config: SimConfig) -> dict[str, float]:
    """The summary of one twin's simulated run."""
    return dict(run_simulation(config).summary)


def simulate_all(
    report: dict[str, Any],
    checkpoint: Path,
    calibrations: Path,
    workers: int,
    *,
    before_context_weight: bool = False,
    shared_kv: bool = True,
) -> dict[tuple[str, str, int, int], dict[str, float]]:
    """(engine, calibration, load, seed) -> the simulated summary, for every finished run;
    `shared_kv` False: each calibration's shared-prefix term left out."""
    jobs: dict[tuple[str, str, int, int], SimConfig] = {}
    for run in report["runs"]:
        if "failed" in run or "error" in run.get("metrics", {"error": 1}):
            continue
        engine, load, seed = run["server"], run["agents"], run["seed"]
        for name in CALIBRATIONS[engine]:
            path = calibrations / f"{name}.json"
            jobs[(engine, name, load, seed)] = sim_config(
                report,
                checkpoint,
                engine,
                load,
                seed,
                path,
                before_context_weight=before_context_weight,
            )
    if not shared_kv:
        jobs = {key: without_shared_kv(config) for key, config in jobs.items()}
    print(f"simulating {len(jobs)} runs", file=sys.stderr, flush=True)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(simulate_summary, jobs.values()))
    return dict(zip(jobs, results, strict=True))


# ----- calibrations on both sides of a set ------------------------------------------------------

MEASURED = "measured.json"  # when a folder's calibrations were measured: {"began", "ended"}


def now_iso() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def write_measured(folder: Path, began: str, ended: str) -> None:
    (folder / MEASURED).write_text(json.dumps({"began": began, "ended": ended}) + "\n")


def midpoint(stamp: Mapping[str, Any]) -> float:
    """The midpoint of a stamp's (a calibration set's `measured.json`, or a run's) `began` and
    `ended`, ISO times, as a POSIX time."""
    start = datetime.fromisoformat(stamp["began"]).timestamp()
    return (start + datetime.fromisoformat(stamp["ended"]).timestamp()) / 2


def measured_stamp(folder: Path) -> dict[str, str]:
    """When `folder`'s calibrations were measured: its `measured.json`, {"began", "ended"}.
    Exits naming the file when it is missing or unreadable."""
    path = folder / MEASURED
    try:
        stamp = json.loads(path.read_text())
        midpoint(stamp)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(
            f"--calibrations-after: {path} is not a readable measurement time ({exc}); "
            "calibrate with --calibrate, which writes it, or write "
            '{"began": ISO-TIME, "ended": ISO-TIME}'
        ) from None
    return {"began": stamp["began"], "ended": stamp["ended"]}


def run_weights(
    runs: Sequence[Mapping[str, Any]], times: tuple[float, float], load_key: str
) -> dict[tuple[str, Any, int], float]:
    """(engine, load, seed) -> how far each finished run's midpoint lies from the calibrations
    measured at `times[0]` (0) to those at `times[1]` (1), clamped to [0, 1]; the load is the
    run's `load_key` (`agents`, `time_scale`). Exits naming a run without its times (a report
    from before they were recorded)."""
    before_s, after_s = times
    if after_s <= before_s:
        raise SystemExit(
            "--calibrations-after: its calibrations must be measured after --calibrations'"
        )
    weights = {}
    for run in runs:
        if "failed" in run or "error" in run.get("metrics", {"error": 1}):
            continue
        key = (run["server"], run[load_key], run["seed"])
        if "began" not in run or "ended" not in run:
            raise SystemExit(
                f"--calibrations-after: the run {key[0]} {load_key}={key[1]:g} seed {key[2]} "
                "has no began/ended times: rerun the set to bracket it"
            )
        weights[key] = min(max((midpoint(run) - before_s) / (after_s - before_s), 0.0), 1.0)
    return weights


def bracketed(
    runs: Sequence[Mapping[str, Any]],
    load_key: str,
    stamps: tuple[Mapping[str, Any], Mapping[str, Any]],
    before: Mapping[tuple[str, str, Any, int], Mapping[str, Any]],
    after: Mapping[tuple[str, str, Any, int], Mapping[str, Any]],
) -> dict[tuple[str, str, Any, int], dict[str, float]]:
    """The runs' twins, simulated with the calibrations measured at `stamps[0]` (`before`) and
    at `stamps[1]` (`after`), each interpolated by the hour its run ran."""
    weights = run_weights(runs, (midpoint(stamps[0]), midpoint(stamps[1])), load_key)
    return interpolated(weights, before, after)


def interpolated(
    weights: Mapping[tuple[str, Any, int], float],
    before: Mapping[tuple[str, str, Any, int], Mapping[str, Any]],
    after: Mapping[tuple[str, str, Any, int], Mapping[str, Any]],
) -> dict[tuple[str, str, Any, int], dict[str, float]]:
    """Each run's twin, (engine, calibration, load, seed), between its simulation with the
    calibrations before and with those after: every metric both report, (1 - w) x before +
    w x after, w the run's weight, `weights[(engine, load, seed)]`."""
    out: dict[tuple[str, str, Any, int], dict[str, float]] = {}
    for key, first in before.items():
        last, w = after.get(key), weights[(key[0], key[2], key[3])]
        if last is None:
            continue
        out[key] = {
            metric: (1 - w) * value + w * last[metric]
            for metric, value in first.items()
            if isinstance(value, int | float) and isinstance(last.get(metric), int | float)
        }
    return out


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(kept) if kept else None


def fidelity_rows(
    report: dict[str, Any], simulated: dict[tuple[str, str, int, int], dict[str, float]]
) -> list[dict[str, Any]]:
    """One row per engine, calibration, load and metric: means over the seeds both sides ran."""
    measured = {
        (r["server"], r["agents"], r["seed"]): r["metrics"]
        for r in report["runs"]
        if "failed" not in r and "error" not in r.get("metrics", {"error": 1})
    }
    return compare_rows(measured, simulated, METRICS, lambda load: f"agents={load}")


def compare_rows(
    measured: Mapping[tuple[str, Any, int], Mapping[str, Any]],
    simulated: Mapping[tuple[str, str, Any, int], Mapping[str, Any]],
    metrics: Sequence[str],
    label: Callable[[Any], str],
) -> list[dict[str, Any]]:
    """The rows of `simulated` (engine, calibration, load, seed) against `measured` (engine,
    load, seed): per engine, calibration, load and metric the means over the seeds simulated,
    `error` = simulated / measured - 1, and the per-seed values; `label(load)` names the load."""
    rows: list[dict[str, Any]] = []
    for engine, name, load in sorted({k[:3] for k in simulated}):
        seeds = sorted(k[3] for k in simulated if k[:3] == (engine, name, load))
        for metric in metrics:
            real = [measured[(engine, load, s)].get(metric) for s in seeds]
            sim = [simulated[(engine, name, load, s)].get(metric) for s in seeds]
            m, s = _mean(real), _mean(sim)
            rows.append(
                {
                    "engine": engine,
                    "calibration": name,
                    "load": label(load),
                    "metric": metric,
                    "measured": m,
                    "simulated": s,
                    "error": None if m is None or s is None or m == 0 else s / m - 1,
                    "scored": True,
                    "per_seed": {"seeds": seeds, "measured": real, "simulated": sim},
                }
            )
    return rows


def markdown(rows: list[dict[str, Any]], metrics: Sequence[str] = METRICS) -> str:
    """The error table: a line per engine, calibration and load, a column per metric (a miss of
    its goal marked)."""
    lines = [
        "| engine | calibration | load | " + " | ".join(metrics) + " |",
        "|---" * (3 + len(metrics)) + "|",
    ]
    index = {(r["engine"], r["calibration"], r["load"], r["metric"]): r for r in rows}
    for engine, name, load in dict.fromkeys(
        (r["engine"], r["calibration"], r["load"]) for r in rows
    ):
        cells = []
        for metric in metrics:
            err = index[(engine, name, load, metric)]["error"]
            goal = GOALS.get(metric)
            mark = "" if err is None or goal is None or abs(err) <= goal + 1e-9 else " ✗"
            cells.append("-" if err is None else f"{err:+.0%}{mark}")
        lines.append(f"| {engine} | {name} | {load} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--report", type=Path, required=True, help="an e1_real.py report (merged seeds and loads)")
    add("--calibrations", type=Path, default=ROOT / "runs" / "fidelity", help="calibration folder")
    add("--calibrate", action="store_true", help="measure the three calibrations first")
    add(
        "--calibrations-after",
        type=Path,
        default=None,
        help="calibrations measured after the runs: each twin interpolated between the two "
        "by the hour its run ran (both folders need measured.json, which --calibrate writes)",
    )
    add("--vllm-python", default="/tmp/vllm-venv/bin/python")
    add_sharing_options(add)
    add("--threads", type=int, default=len(os.sched_getaffinity(0)))
    add("--workers", type=int, default=2, help="simulations at once")
    add("--out", type=Path, default=None, help="also write the report here")
    add(
        "--before-context-weight",
        action="store_true",
        help="the report's hybridserve runs were served before the preset's context weight: "
        "simulate them without it (the reports of docs/ before it)",
    )
    return parser.parse_args(argv)


# The calibrations measure decode batches with half of every context shared too, and fit the
# cost model's shared_kv on them: E1's decodes all read one system prompt's blocks, and on a
# set calibrated before and after with the term, its twins missed 6 of 30 goals against 12
# without it (docs/fidelity.md, "The shared-prompt term, measured in the hour of the runs").
DECODE_SHARED_FRACTION = 0.5


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a share in [0, 1), e.g. 0.5 (0: none)")
    return value


def add_sharing_options(add: Callable[..., Any]) -> None:
    """The shared-prefix term's options (`--decode-shared-fraction`, `--without-shared-kv`)."""
    add(
        "--decode-shared-fraction",
        type=_share,
        default=DECODE_SHARED_FRACTION,
        help="with --calibrate: measure every calibration's decode batches again with this share "
        "of each context shared and fit its shared_kv (E1's decodes share a 1,000-token system "
        f"prompt; docs/fidelity.md); 0 measures none [default: {DECODE_SHARED_FRACTION}]",
    )
    add(
        "--without-shared-kv",
        action="store_true",
        help="simulate the twins with the calibrations' shared_kv set to 0 (the term left out)",
    )


CALIBRATION_SET = ("torch-own", "torch-http", "vllm-http")


def read_set(folder: Path) -> dict[str, Any]:
    """The three calibrations of `folder`, by name."""
    return {n: json.loads((folder / f"{n}.json").read_text()) for n in CALIBRATION_SET}


def calibrate_set(args: argparse.Namespace, checkpoint: Path) -> None:
    """Measure the three calibrations into --calibrations, and when (`measured.json`)."""
    args.calibrations.mkdir(parents=True, exist_ok=True)
    began = now_iso()
    calibrate_own(args, checkpoint)
    for name in ("torch-http", "vllm-http"):
        calibrate_http(args, name, checkpoint)
    write_measured(args.calibrations, began, now_iso())


def score(args: argparse.Namespace, report: dict[str, Any], checkpoint: Path) -> dict[str, Any]:
    """The report's twins with --calibrations, bracketed by --calibrations-after when given:
    the rows and the calibrations they were scored with."""
    folders = [args.calibrations, *([args.calibrations_after] if args.calibrations_after else [])]
    for folder in folders:
        missing = [n for n in CALIBRATION_SET if not (folder / f"{n}.json").is_file()]
        if missing:
            raise SystemExit(f"--calibrations {folder}: no {', '.join(missing)}; use --calibrate")
    out = {"report": str(args.report), "setup": args.setup, "pool": report["pool"]}
    out["shared_kv_left_out"] = args.without_shared_kv
    out["calibrations"] = read_set(args.calibrations)
    if args.calibrations_after is not None:  # its times read before any simulation
        stamps = (measured_stamp(args.calibrations), measured_stamp(args.calibrations_after))
        out["calibrations_after"] = read_set(args.calibrations_after)
        out["calibrations_measured"] = {"calibrations": stamps[0], "calibrations_after": stamps[1]}
    weight = args.before_context_weight
    simulated = [
        simulate_all(
            report,
            checkpoint,
            f,
            args.workers,
            before_context_weight=weight,
            shared_kv=not args.without_shared_kv,
        )
        for f in folders
    ]
    if args.calibrations_after is not None:
        simulated = [bracketed(report["runs"], "agents", stamps, simulated[0], simulated[1])]
    out["rows"] = fidelity_rows(report, simulated[0])
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        report = json.loads(args.report.read_text())
        args.setup = report["setup"]
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"--report {args.report}: not an e1_real report ({err})") from None
    checkpoint = hf_checkpoint(args.setup["model"])
    if args.calibrate:
        calibrate_set(args, checkpoint)
    out = score(args, report, checkpoint)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(markdown(out["rows"]), file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
