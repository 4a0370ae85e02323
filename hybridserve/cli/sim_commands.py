"""`hybridserve simulate` and `hybridserve bench` (experiment E1)."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hybridserve.cli.app import app, err, fail, install_hint, out_console
from hybridserve.cli.choices import GPU_HELP, MODEL_HELP, SPEC_HELP
from hybridserve.core.errors import ConfigError, HybridServeError

if TYPE_CHECKING:
    from hybridserve.sim.run import SimConfig, SimRun
    from hybridserve.sim.sweep import Trial

REPORT_KEYS = (
    "job_goodput_per_hour",
    "jobs_completed",
    "itl_p50_ms",
    "itl_p99_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "prefix_hit_rate",
    "preemptions",
    "output_tokens_per_s",
    "tpot_mean_ms",
)


def _sim_config(*, num_agents: int, **options: Any) -> SimConfig:
    """Import the simulator only when a simulation command runs."""
    from hybridserve.sim.run import SimConfig
    from hybridserve.sim.workload import AgentParams

    return SimConfig(agents=AgentParams(num_agents=num_agents), **options)


def _run_sim(config: SimConfig, *, label: str, quiet: bool) -> SimRun:
    """One run, with a progress bar in simulated seconds on stderr unless `quiet`."""
    from hybridserve.sim.run import run_simulation

    # The measured-CPU option needs a clock; the simulator never reads one itself.
    clock = time.perf_counter if config.include_scheduler_cpu else None
    if quiet:
        return run_simulation(config, cpu_clock=clock)
    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        TextColumn("{task.completed:.0f} / {task.total:.0f} simulated s"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(label, total=config.duration_s)
        return run_simulation(
            config, progress=lambda now: bar.update(task, completed=now), cpu_clock=clock
        )


def _file_options(config_file: Path | None) -> dict[str, Any]:
    """SimConfig overrides from a --config TOML file (scheduler fields and cache retention)."""
    if config_file is None:
        return {}
    from hybridserve.sim.config_file import load_config_file

    loaded = load_config_file(config_file)
    return {"controls": loaded.scheduler, "retention": loaded.retention}


def _model_options(model_config: Path | None) -> dict[str, Any]:
    """SimConfig fields of --model-config (the parsed model beats --model)."""
    return {} if model_config is None else {"model_config": str(model_config)}


def _device_options(
    gpu: str | None, dtype: str | None, kv_dtype: str | None, calibration: Path | None
) -> dict[str, Any]:
    """SimConfig fields of --gpu, --dtype, --kv-dtype and --calibration. A calibration profile
    sets the device (its GpuSpec), the Efficiency constants and, unless given, the dtypes it
    was measured in; a --gpu naming another device is an error."""
    if calibration is None:
        return {"gpu": gpu or "H200", "dtype": dtype or "fp8", "kv_dtype": kv_dtype or "bf16"}
    from hybridserve.sim.calibration import CalibrationProfile

    profile = CalibrationProfile.load(calibration)
    if gpu is not None and gpu != profile.device:
        raise ConfigError(
            "--gpu",
            gpu,
            f"--calibration {calibration} was measured on {profile.device}; drop --gpu "
            "(the profile sets the device)",
        )
    return {
        "gpu": profile.device,
        "gpu_spec": profile.gpu,
        "efficiency": profile.efficiency,
        "dtype": dtype or profile.dtype,
        "kv_dtype": kv_dtype or profile.kv_dtype,
    }


def run_label(preset: str, config_file: Path | None) -> str:
    """What a run is called in tables, plots and report.json: its preset, and the --config file
    that changed it (a modified baseline is not the baseline)."""
    return preset if config_file is None else f"{preset} + {config_file.name}"


def interrupted(what: str) -> typer.Exit:
    """Ctrl-C: say what happened to the work, and exit 130 (128 + SIGINT), as shells expect."""
    err.print(f"interrupted: {what}", soft_wrap=True)
    return typer.Exit(code=130)


def bench_folder(name: str | None, now: float | None = None) -> Path:
    """runs/NAME, or a new runs/e1-YYYYmmdd-HHMMSS (never an earlier run's folder)."""
    if name is not None:
        return Path("runs") / name
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    folder, n = Path("runs") / f"e1-{stamp}", 1
    while folder.exists():
        n += 1
        folder = Path("runs") / f"e1-{stamp}-{n}"
    return folder


def _bench_interrupted(runs: dict[str, SimRun], labels: dict[str, str], folder: Path) -> typer.Exit:
    """Ctrl-C during bench: write the runs that finished (no ratios) and say where."""
    if not runs:
        return interrupted("no run had finished; nothing was written")
    report: dict[str, object] = {p: _metrics_json(r.summary) for p, r in runs.items()}
    report["interrupted"] = True
    files = _write_report(folder, report, {labels[p]: r for p, r in runs.items()})
    done = ", ".join(runs)
    return interrupted(f"finished runs ({done}) were written to {files[0]}")


def _sweep_interrupted(finished: list[Trial], total: int, itl_slo_ms: float) -> typer.Exit:
    """Ctrl-C during sweep: write the finished trials to a new file and say where."""
    if not finished:
        return interrupted(f"none of the {total} trials had finished; nothing was written")
    path = Path("runs") / f"sweep-interrupted-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"controls": dict(t.controls), **_metrics_json(t.metrics)} for t in finished]
    payload = {"itl_slo_ms": itl_slo_ms, "interrupted": True, "trials": rows}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return interrupted(f"{len(finished)} of {total} trials had finished; written to {path}")


def shown_keys(workload: str) -> tuple[str, ...]:
    """The table's metrics: job goodput only where there are jobs (the agents workload); a
    trace or benchmark workload leads with requests and throughput instead."""
    if workload.partition(":")[0] == "agents":
        return REPORT_KEYS
    jobless = tuple(k for k in REPORT_KEYS if not k.startswith("job"))
    return (
        "requests_completed",
        "output_tokens_per_s",
        *(k for k in jobless if k != "output_tokens_per_s"),
    )


def _default_warmup(workload: str) -> float:
    """0 for a workload that runs out of requests (it may end before 300 s), else 300."""
    from hybridserve.sim.run import finite_workload

    return 0.0 if finite_workload(workload) else 300.0


def _warn_about_run(run: SimRun) -> None:
    """Say on stderr what the numbers alone hide: rejected requests and a queue that never
    drains."""
    if run.rejected:
        shown = ", ".join(
            f"{rid} (request {int(rid[1:]) + 1} of the trace, {length:,} tokens)"
            if rid[1:].isdigit()
            else f"{rid} ({length:,} tokens)"
            for rid, length, _ in run.rejected[:3]
        )
        more = f" and {len(run.rejected) - 3} more" if len(run.rejected) > 3 else ""
        err.print(
            f"warning: {len(run.rejected)} requests were rejected, not run: {shown}{more}; "
            f"{run.rejected[0][2]}. Raise --max-model-len to keep them.",
            soft_wrap=True,
        )
    s = run.summary
    if s.get("never_drains"):
        err.print(
            f"warning: the run never drains: the waiting queue grew through the window (mean "
            f"{s['waiting_first_quarter']:.0f} requests in its first quarter, "
            f"{s['waiting_last_quarter']:.0f} in its last), so arrivals outpace this "
            "configuration and latencies keep growing with the run's length instead of settling. "
            "Lower the "
            "load (--time-scale above 1, fewer --agents) or compare another --preset.",
            soft_wrap=True,
        )


def _simulated_model(config: SimConfig) -> tuple[str, str]:
    """(the model's name, the speculative method) that `config` simulates: the profile parsed
    from --model-config when given, and the resolved --spec (auto: from the model)."""
    from hybridserve.sim.run import model_profile, speculative_method

    profile = model_profile(config)
    return profile.name, speculative_method(config.spec, profile)


def _write_report(folder: Path, report: dict[str, object], runs: dict[str, SimRun]) -> list[Path]:
    """report.json plus the PNG plots (skipped, with a note, when matplotlib is absent)."""
    from hybridserve.cli.plots import plots_available, write_plots

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    if not plots_available():
        err.print(
            f"plots skipped: matplotlib is not installed ({install_hint('sim')})", markup=False
        )
        return [path]
    return [path, *write_plots(folder, runs)]


def _metrics_json(summary: dict[str, float]) -> dict[str, float | None]:
    """Rounded values; an undefined statistic (no sample in the window) becomes null."""
    return {k: None if math.isnan(v) else round(v, 4) for k, v in summary.items()}


SimOption = Annotated[str, typer.Option(help=MODEL_HELP)]
GpuOption = Annotated[str, typer.Option(help=GPU_HELP)]
DtypeOption = Annotated[str, typer.Option(help="Weight dtype: bf16, fp8, fp4.")]
SimGpuOption = Annotated[
    str | None,
    typer.Option(help=f"{GPU_HELP[:-1]} [default: H200, or the calibration's]."),
]
SimDtypeOption = Annotated[
    str | None,
    typer.Option(help="Weight dtype: bf16, fp8, fp4, fp32 [default: fp8, or the calibration's]."),
]
TpOption = Annotated[int, typer.Option(help="Tensor-parallel width.")]
SpecOption = Annotated[
    str,
    typer.Option(help=f"{SPEC_HELP} auto: mtp when the model has MTP layers, else none."),
]
AgentsOption = Annotated[int, typer.Option(help="Agents running jobs back to back.")]
DurationOption = Annotated[float, typer.Option(help="Simulated seconds (per run).")]
WarmupOption = Annotated[float, typer.Option(help="Seconds excluded from the metrics.")]
SeedOption = Annotated[int, typer.Option(help="Seed: same seed, same report.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config", help="TOML file: [scheduler] fields and [cache] retention over the preset."
    ),
]
ModelConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--model-config",
        help="A Hugging Face config.json (or its folder): simulate that model instead of --model.",
    ),
]
KvDtypeOption = Annotated[
    str | None,
    typer.Option(
        help="KV cache / recurrent state dtype: bf16, fp16, fp8, fp32 [default: bf16, or the "
        "calibration's]."
    ),
]
CalibrationOption = Annotated[
    Path | None,
    typer.Option(
        "--calibration",
        help="A profile from `hybridserve calibrate`: its device and fitted cost-model "
        "constants (conflicts with a different --gpu).",
    ),
]
CpuOption = Annotated[
    bool,
    typer.Option(help="Add the measured schedule()+update() CPU time to every step (not seeded)."),
]


@app.command("simulate")
def simulate_cmd(
    model: SimOption = "qwen3-next-80b-a3b",
    gpu: SimGpuOption = None,
    tp: TpOption = 1,
    dtype: SimDtypeOption = None,
    preset: Annotated[
        str, typer.Option(help="baseline, hybridserve, controls-only or retention-only.")
    ] = "hybridserve",
    agents: AgentsOption = 20,
    duration: DurationOption = 1800.0,
    warmup: Annotated[
        float | None,
        typer.Option(
            help="Seconds excluded from the metrics [default: 300, or 0 for a workload with a "
            "fixed number of requests: a trace, poisson, fixed with requests=N]."
        ),
    ] = None,
    spec: SpecOption = "auto",
    workload: Annotated[
        str,
        typer.Option(
            help="agents, mooncake:PATH, azure:PATH, poisson:rate=R,requests=N, "
            "fixed:input=I,output=O,concurrency=C[,requests=N] (closed loop) or "
            "fixed:input=I,output=O,rate=R[,requests=N] (Poisson)"
        ),
    ] = "agents",
    time_scale: Annotated[float, typer.Option(help="Multiply trace arrival times.")] = 1.0,
    limit: Annotated[int | None, typer.Option(help="Keep the first N trace requests.")] = None,
    max_model_len: Annotated[
        int | None,
        typer.Option(
            help="Context limit in tokens; longer trace requests are rejected and counted "
            "[default: 131073, the agents' context limit + 1]."
        ),
    ] = None,
    config_file: ConfigOption = None,
    include_scheduler_cpu: CpuOption = False,
    model_config: ModelConfigOption = None,
    kv_dtype: KvDtypeOption = None,
    calibration: CalibrationOption = None,
    out: Annotated[
        Path | None, typer.Option(help="Also write report.json and plots to this folder.")
    ] = None,
    seed: SeedOption = 0,
    as_json: JsonOption = False,
) -> None:
    """Simulate a workload on a modelled GPU: job goodput, TTFT, ITL, prefix hits."""
    try:
        config = _sim_config(
            model=model,
            tp=tp,
            preset=preset,
            num_agents=agents,
            duration_s=duration,
            warmup_s=_default_warmup(workload) if warmup is None else warmup,
            spec=spec,
            seed=seed,
            workload=workload,
            time_scale=time_scale,
            limit=limit,
            max_model_len=max_model_len,
            include_scheduler_cpu=include_scheduler_cpu,
            **_model_options(model_config),
            **_device_options(gpu, dtype, kv_dtype, calibration),
            **_file_options(config_file),
        )
        label = run_label(preset, config_file)
        run = _run_sim(config, label=f"simulate ({label})", quiet=as_json)
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        raise interrupted("the run did not finish; nothing was written") from None
    summary = run.summary
    _warn_about_run(run)
    name, method = _simulated_model(config)
    if out is not None:
        setup = {"model": name, "spec": method, "gpu": config.gpu, "workload": workload}
        _write_report(out, {label: _metrics_json(summary), "setup": setup}, {label: run})
    if as_json:
        sys.stdout.write(json.dumps(_metrics_json(summary)) + "\n")
        return
    where = f"{config.gpu} (tp={tp}, {config.dtype})"
    console = out_console()
    console.print(f"simulate: {name} (spec {method}) on {where}, {label}")
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in shown_keys(workload):
        table.add_row(key, f"{summary[key]:,.3f}")
    if summary["requests_rejected"]:
        table.add_row("requests_rejected", f"{summary['requests_rejected']:,.0f}")
    console.print(table)


@app.command("bench")
def bench_cmd(
    model: SimOption = "qwen3-next-80b-a3b",
    gpu: SimGpuOption = None,
    tp: TpOption = 1,
    dtype: SimDtypeOption = None,
    spec: SpecOption = "auto",
    agents: AgentsOption = 20,
    duration: DurationOption = 1800.0,
    warmup: WarmupOption = 300.0,
    seed: SeedOption = 0,
    config_file: ConfigOption = None,
    model_config: ModelConfigOption = None,
    kv_dtype: KvDtypeOption = None,
    calibration: CalibrationOption = None,
    name: Annotated[
        str | None,
        typer.Option(
            help="Run name: files go under runs/NAME/ [default: a new runs/e1-DATE-TIME/]."
        ),
    ] = None,
    ablations: Annotated[
        bool, typer.Option(help="Also run controls-only and retention-only.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Experiment E1: the vLLM baseline against hybridserve, side by side, with ratios."""
    runs: dict[str, SimRun] = {}
    presets = ["baseline", "hybridserve"]
    if ablations:
        presets += ["controls-only", "retention-only"]
    from hybridserve.sim.run import with_preset

    # A --config file shapes the hybridserve side only: the baseline stays vLLM.
    labels = {p: p if p == "baseline" else run_label(p, config_file) for p in presets}
    folder = bench_folder(name)
    try:
        config = _sim_config(
            model=model,
            tp=tp,
            spec=spec,
            num_agents=agents,
            duration_s=duration,
            warmup_s=warmup,
            seed=seed,
            **_model_options(model_config),
            **_device_options(gpu, dtype, kv_dtype, calibration),
        )
        simulated = _simulated_model(config)
        for preset in presets:
            extra = _file_options(config_file) if preset != "baseline" else {}
            chosen = replace(with_preset(config, preset), **extra)
            runs[preset] = _run_sim(chosen, label=labels[preset], quiet=as_json)
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        raise _bench_interrupted(runs, labels, folder) from None
    results = {preset: run.summary for preset, run in runs.items()}
    base, ours = results["baseline"], results["hybridserve"]
    ratios = {k: round(ours[k] / base[k], 4) if base[k] else None for k in REPORT_KEYS}
    report: dict[str, object] = {
        "baseline": _metrics_json(base),
        "hybridserve": _metrics_json(ours),
        "ratios": ratios,
        **{preset: _metrics_json(results[preset]) for preset in presets[2:]},
        "setup": {
            "model": simulated[0],
            "spec": simulated[1],
            "gpu": config.gpu,
            "tp": tp,
            "dtype": config.dtype,
            "kv_dtype": config.kv_dtype,
            "model_config": None if model_config is None else str(model_config),
            "calibration": None if calibration is None else str(calibration),
            "agents": agents,
            "duration_s": duration,
            "warmup_s": warmup,
            "seed": seed,
            "config": None if config_file is None else str(config_file),
            "labels": labels,
        },
    }
    files = _write_report(folder, report, {labels[p]: run for p, run in runs.items()})
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
        return
    where = f"simulated {config.gpu} (tp={tp}, {config.dtype})"
    table = Table(title=f"E1: {agents} agents, {simulated[0]} (spec {simulated[1]}) on {where}")
    headers = ("metric", "baseline (vLLM)", labels["hybridserve"], "ratio")
    for column in (*headers, *(labels[p] for p in presets[2:])):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for key in REPORT_KEYS:
        ratio = ratios[key]
        cells = [f"{results[p][key]:,.2f}" for p in presets[2:]]
        table.add_row(
            key,
            f"{base[key]:,.2f}",
            f"{ours[key]:,.2f}",
            "-" if ratio is None else f"{ratio:.2f}x",
            *cells,
        )
    console = out_console()
    console.print(table)
    console.print("files: " + ", ".join(str(f) for f in files))


@app.command("sweep")
def sweep_cmd(
    trials: Annotated[int, typer.Option(help="Random control settings to try (plus all-off).")] = 8,
    workers: Annotated[int, typer.Option(help="Local worker processes.")] = 1,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            help="Run trials on a Ray cluster: auto, ray://HOST:10001, or local (needs the "
            "ray extra).",
        ),
    ] = None,
    itl_slo_ms: Annotated[float, typer.Option(help="p99 ITL SLO in milliseconds.")] = 150.0,
    model: SimOption = "qwen3-next-80b-a3b",
    gpu: SimGpuOption = None,
    tp: TpOption = 1,
    dtype: SimDtypeOption = None,
    spec: SpecOption = "auto",
    model_config: ModelConfigOption = None,
    kv_dtype: KvDtypeOption = None,
    agents: AgentsOption = 20,
    duration: DurationOption = 900.0,
    warmup: WarmupOption = 150.0,
    seed: SeedOption = 0,
    as_json: JsonOption = False,
) -> None:
    """Search the scheduler controls for the best job goodput under a p99 ITL SLO."""
    from hybridserve.sim.run import model_profile, state_quantum
    from hybridserve.sim.sweep import best, sweep

    if trials < 1 or workers < 1:
        raise fail(f"--trials={trials} --workers={workers}; use 1 or more of each")
    finished: list[Trial] = []
    try:
        config = _sim_config(
            model=model,
            tp=tp,
            spec=spec,
            num_agents=agents,
            duration_s=duration,
            warmup_s=warmup,
            seed=seed,
            **_model_options(model_config),
            **_device_options(gpu, dtype, kv_dtype, None),
        )
        quantum = state_quantum(model_profile(config))
        results = sweep(
            config,
            trials=trials,
            quantum=quantum,
            workers=workers,
            seed=seed,
            ray_address=ray,
            on_trial=finished.append,
        )
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        raise _sweep_interrupted(finished, trials + 1, itl_slo_ms) from None
    winner = best(results, itl_slo_ms=itl_slo_ms)
    rows = [
        {"controls": dict(t.controls), **_metrics_json(t.metrics), "meets_slo": t.meets(itl_slo_ms)}
        for t in results
    ]
    if as_json:
        payload = {"itl_slo_ms": itl_slo_ms, "best": dict(winner.controls), "trials": rows}
        sys.stdout.write(json.dumps(payload) + "\n")
        return
    table = Table(title=f"sweep: {len(results)} trials, p99 ITL SLO {itl_slo_ms:.0f} ms")
    for column in ("controls", "job goodput/h", "p99 ITL ms", "TTFT p50 ms", "SLO"):
        table.add_column(column, justify="left" if column == "controls" else "right")
    for trial in sorted(results, key=lambda t: -t.metrics["job_goodput_per_hour"]):
        label = ", ".join(f"{k}={v:g}" for k, v in trial.controls if v) or "all off"
        m = trial.metrics
        table.add_row(
            label,
            f"{m['job_goodput_per_hour']:.1f}",
            f"{m['itl_p99_ms']:.1f}",
            f"{m['ttft_p50_ms']:.0f}",
            "yes" if trial.meets(itl_slo_ms) else "no",
        )
    console = out_console()
    console.print(table)
    console.print(f"best under the SLO: {dict(winner.controls) or 'all off'}")
