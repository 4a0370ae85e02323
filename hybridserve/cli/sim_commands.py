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


def _bench_interrupted(
    finished: dict[str, dict[int, dict[str, float]]], folder: Path
) -> typer.Exit:
    """Ctrl-C during bench: write the runs that finished (per configuration and seed, no
    ratios) and say where."""
    done = {label: by_seed for label, by_seed in finished.items() if by_seed}
    if not done:
        return interrupted("no run had finished; nothing was written")
    report: dict[str, object] = {
        label: {str(seed): _metrics_json(summary) for seed, summary in sorted(by_seed.items())}
        for label, by_seed in done.items()
    }
    report["interrupted"] = True
    files = _write_report(folder, report, {})
    return interrupted(f"finished runs ({', '.join(done)}) were written to {files[0]}")


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
    from hybridserve.metrics.plots import plots_available, write_plots

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    if not runs:
        return [path]
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
DcpOption = Annotated[
    int,
    typer.Option(
        help="Decode-context-parallel width: full-attention KV sharded over N of the TP ranks "
        "(lookups in block_size*N units, state groups replicated); --tp defaults to N."
    ),
]
SimTpOption = Annotated[
    int | None, typer.Option(help="Tensor-parallel width [default: the --dcp width, or 1].")
]
BoundOption = Annotated[
    str | None,
    typer.Option(
        help="Run an upper bound instead: free-prefill, ideal-hits or infinite-engine "
        "(tool time only)."
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
    tp: SimTpOption = None,
    dtype: SimDtypeOption = None,
    dcp: DcpOption = 1,
    bound: BoundOption = None,
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
    replicas: Annotated[
        int | None,
        typer.Option(
            help="Simulate a fleet of N replicas behind --router (adds a `fleet` report) "
            "[default: one engine, no router]."
        ),
    ] = None,
    router: Annotated[
        str,
        typer.Option(
            help="Fleet router: round-robin, least-loaded, session, prefix-fa (full-attention "
            "overlap) or prefix-hybrid (the reconciled hit)."
        ),
    ] = "round-robin",
    router_view: Annotated[
        str,
        typer.Option(
            help="What the router sees of a replica's cache: precise (the cache itself) or "
            "approximate (its own routing history, in an LRU)."
        ),
    ] = "precise",
    router_load_weight: Annotated[
        float,
        typer.Option(help="Prefix routers: score = overlap tokens - weight x outstanding tokens."),
    ] = 1.0,
    pd: Annotated[
        str | None,
        typer.Option(
            help="Disaggregate: P:D prefill and decode replicas (P + D = --replicas, which it "
            "implies); KV and state move over --pd-link."
        ),
    ] = None,
    pd_link: Annotated[
        str, typer.Option(help="The prefill-to-decode link: nvlink (the GPU's) or ib-ndr.")
    ] = "nvlink",
) -> None:
    """Simulate a workload on a modelled GPU: job goodput, TTFT, ITL, prefix hits."""
    from hybridserve.sim.run import pool_report

    tp = tp if tp is not None else dcp
    try:
        config = _sim_config(
            model=model,
            tp=tp,
            dcp=dcp,
            bound=bound,
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
        pool = pool_report(config)
        fleet_report: dict[str, Any] | None = None
        split = _pd_split(pd)
        if split is not None and replicas is None:
            replicas = sum(split)
        routed = (router, router_view, router_load_weight) != ("round-robin", "precise", 1.0)
        if replicas is None and (routed or pd_link != "nvlink"):
            raise ConfigError(
                "replicas (--replicas)", None, "the --router options need a fleet: add --replicas N"
            )
        if replicas is None:
            run = _run_sim(config, label=f"simulate ({label})", quiet=as_json)
        else:
            run, fleet_report = _run_fleet(
                config,
                replicas=replicas,
                router=router,
                view=router_view,
                load_weight=router_load_weight,
                pd=split,
                pd_link=pd_link,
            )
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        raise interrupted("the run did not finish; nothing was written") from None
    summary = dict(run.summary)
    summary["kv_cache_tokens"] = float(pool["kv_cache_tokens"])
    summary["max_concurrency"] = float(pool["max_concurrency"])
    _warn_about_run(run)
    name, method = _simulated_model(config)
    if out is not None:
        setup = {"model": name, "spec": method, "gpu": config.gpu, "workload": workload}
        report: dict[str, object] = {label: _metrics_json(summary), "pool": pool, "setup": setup}
        _write_report(out, report, {label: run})
    if as_json:
        payload: dict[str, Any] = dict(_metrics_json(summary))
        if fleet_report is not None:
            payload["fleet"] = fleet_json(fleet_report)
        sys.stdout.write(json.dumps(payload) + "\n")
        return
    where = f"{config.gpu} (tp={tp}, dcp={dcp}, {config.dtype})"
    extra = f", bound={bound}" if bound else ""
    console = out_console()
    console.print(f"simulate: {name} (spec {method}) on {where}, {label}{extra}")
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in (*shown_keys(workload), *BREAKDOWN_ROWS):
        value = summary.get(key, math.nan)
        table.add_row(key, "-" if math.isnan(value) else f"{value:,.3f}")
    if summary["requests_rejected"]:
        table.add_row("requests_rejected", f"{summary['requests_rejected']:,.0f}")
    console.print(table)
    if fleet_report is not None:
        console.print(fleet_table(fleet_report))
    for line in pool["vllm_log"]:
        console.print(f"vLLM would log: {line}")


# ----- fleet (hybridserve.sim.fleet) -----------------------------------------------------------


def _run_fleet(
    config: SimConfig,
    *,
    replicas: int,
    router: str,
    view: str,
    load_weight: float,
    pd: tuple[int, int] | None,
    pd_link: str,
) -> tuple[SimRun, dict[str, Any]]:
    """A fleet run: its fleet-wide SimRun and its fleet report."""
    from hybridserve.sim.fleet import FleetConfig, run_fleet

    fleet = FleetConfig(
        replicas=replicas,
        router=router,
        view=view,
        load_weight=load_weight,
        pd=pd,
        pd_link=pd_link,
    )
    clock = time.perf_counter if config.include_scheduler_cpu else None
    done = run_fleet(config, fleet, cpu_clock=clock)
    return done.run, done.fleet


def _pd_split(text: str | None) -> tuple[int, int] | None:
    from hybridserve.sim.pd import parse_pd

    return None if text is None else parse_pd(text)


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 4)
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value


def fleet_json(report: dict[str, Any]) -> dict[str, Any]:
    """The fleet report, rounded as the metrics are (an undefined value becomes null)."""
    rounded: dict[str, Any] = _round(report)
    return rounded


def fleet_table(report: dict[str, Any]) -> Table:
    """One row per replica and a fleet row."""
    table = Table(
        title=f"fleet: {report['replicas']} replicas, router {report['router']} "
        f"({report['router_view']}); hit rate {report['hit_rate']:.3f} of a global ideal "
        f"{report['global_ideal_hit_rate']:.3f}; imbalance {report['imbalance']:.2f}"
    )
    columns = (
        "replica",
        "requests_completed",
        "job_goodput_per_hour",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p99_ms",
        "hit_rate",
        "mean_outstanding_tokens",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for row in report["per_replica"]:
        cells = [row[c] for c in columns]
        table.add_row(
            *(
                "-"
                if isinstance(v, float) and math.isnan(v)
                else f"{v:,.3f}"
                if isinstance(v, float)
                else str(v)
                for v in cells
            )
        )
    return table


BREAKDOWN_ROWS = (
    "slo_attainment",
    "gpu_busy_frac",
    "gpu_decode_frac",
    "gpu_prefill_frac",
    "gpu_mixed_frac",
    "job_decode_frac",
    "job_tool_frac",
    "job_queue_ttft_frac",
    "recomputed_prompt_tokens_per_turn",
    "ideal_prompt_tokens_per_turn",
)


@app.command("bench")
def bench_cmd(
    model: SimOption = "qwen3-next-80b-a3b",
    gpu: SimGpuOption = None,
    tp: SimTpOption = None,
    dtype: SimDtypeOption = None,
    spec: SpecOption = "auto",
    dcp: DcpOption = 1,
    baseline: Annotated[
        str,
        typer.Option(help="What hybridserve is compared with: vllm, vllm-tuned or legacy."),
    ] = "vllm",
    agents: AgentsOption = 20,
    seeds: Annotated[
        int,
        typer.Option(
            help="Paired seeds (seed, seed+1, ...): every configuration sees the same jobs."
        ),
    ] = 3,
    duration: DurationOption = 480.0,
    warmup: WarmupOption = 120.0,
    seed: Annotated[int, typer.Option(help="The first seed.")] = 0,
    workers: Annotated[int, typer.Option(help="Local worker processes.")] = 2,
    tuned: Annotated[
        Path | None,
        typer.Option(
            help="--baseline vllm-tuned: the search result to use (the JSON of `sweep --space "
            "vllm --json` or of an earlier bench) instead of searching now."
        ),
    ] = None,
    tune_trials: Annotated[
        int, typer.Option(help="--baseline vllm-tuned: random vLLM settings to try.")
    ] = 16,
    itl_slo_ms: Annotated[
        float, typer.Option(help="--baseline vllm-tuned: the p99 ITL SLO of the search.")
    ] = 100.0,
    bounds: Annotated[
        bool, typer.Option(help="Also run the three upper bounds (on the baseline).")
    ] = True,
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
    """Experiment E1: a baseline against hybridserve on paired seeds, with 95% intervals, the
    upper bounds and where the time goes."""
    from hybridserve.sim.bounds import BOUNDS
    from hybridserve.sim.experiment import baseline_preset, paired_report, run_configs
    from hybridserve.sim.run import pool_report, with_preset

    if seeds < 1 or workers < 1:
        raise fail(f"--seeds={seeds} --workers={workers}; use 1 or more of each")
    tp = tp if tp is not None else dcp
    seed_list = list(range(seed, seed + seeds))
    folder = bench_folder(name)
    finished: dict[str, dict[int, dict[str, float]]] = {}
    try:
        base_preset = baseline_preset(baseline)
        config = _sim_config(
            model=model,
            tp=tp,
            spec=spec,
            dcp=dcp,
            num_agents=agents,
            duration_s=duration,
            warmup_s=warmup,
            seed=seed,
            **_model_options(model_config),
            **_device_options(gpu, dtype, kv_dtype, calibration),
        )
        labels = ["baseline", "hybridserve"] + (
            ["controls-only", "retention-only"] if ablations else []
        )
        presets = {"baseline": base_preset, "hybridserve": "hybridserve"}
        presets.update({p: p for p in labels[2:]})
        configs = {}
        for label in labels:
            # A --config file shapes the hybridserve side only: the baseline stays what it is.
            extra = _file_options(config_file) if label != "baseline" else {}
            configs[label] = replace(with_preset(config, presets[label]), **extra)
        search: dict[str, Any] | None = None
        if baseline == "vllm-tuned":
            configs["baseline"], search = _tuned_baseline(
                configs["baseline"], tuned, trials=tune_trials, slo=itl_slo_ms, workers=workers
            )
            if not as_json:
                err.print(f"vllm-tuned: {search['best']}", highlight=False)
        if bounds:
            for bound in BOUNDS:
                configs[bound] = replace(configs["baseline"], bound=bound)
        pools = {label: pool_report(configs[label]) for label in labels}
        log = None if as_json else (lambda line: err.print(line, highlight=False))
        simulated = _simulated_model(config)
        results, kept = run_configs(
            configs,
            seed_list,
            workers=workers,
            keep_seed=seed_list[0],
            log=log,
            finished=finished,
        )
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        raise _bench_interrupted(finished, folder) from None
    report = paired_report(results, baseline="baseline", ours="hybridserve")
    report["pool"] = pools
    report["setup"] = {
        "model": simulated[0],
        "spec": simulated[1],
        "gpu": config.gpu,
        "tp": tp,
        "dcp": dcp,
        "dtype": config.dtype,
        "kv_dtype": config.kv_dtype,
        "baseline": baseline,
        "baseline_preset": base_preset,
        "model_config": None if model_config is None else str(model_config),
        "calibration": None if calibration is None else str(calibration),
        "agents": agents,
        "duration_s": duration,
        "warmup_s": warmup,
        "seeds": seed_list,
        "vllm_tuned": search,
        "config": None if config_file is None else str(config_file),
        # A --config file shapes the hybridserve side only: the baseline stays what it is.
        "labels": {
            label: label if label == "baseline" else run_label(label, config_file)
            for label in labels
        },
    }
    plotted = {label: kept[label] for label in labels if label in kept}
    files = _write_report(folder, report, plotted)
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
        return
    _print_bench(report, labels, [b for b in BOUNDS if b in results], files)


def _tuned_baseline(
    config: SimConfig, tuned: Path | None, *, trials: int, slo: float, workers: int
) -> tuple[SimConfig, dict[str, Any]]:
    """The vllm-tuned baseline: from a stored search result, or searched now."""
    from hybridserve.sim.experiment import tune_vllm, tuned_config

    if tuned is None:
        return tune_vllm(config, trials=trials, itl_slo_ms=slo, workers=workers, seed=config.seed)
    try:
        data = json.loads(tuned.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("--tuned", str(tuned), f"give a readable JSON file ({exc})") from None
    found = data.get("setup", {}).get("vllm_tuned", data) if isinstance(data, dict) else None
    if not isinstance(found, dict) or not isinstance(found.get("best"), dict):
        raise ConfigError(
            "--tuned", str(tuned), 'it needs {"best": {"controls": {...}, "retention": "..."}}'
        )
    best = found["best"]
    controls, retention = best.get("controls", {}), best.get("retention") or "boundary"
    return tuned_config(config, controls, retention), {**found, "from": str(tuned)}


def _print_bench(
    report: dict[str, Any], labels: list[str], bounds: list[str], files: list[Path]
) -> None:
    setup = report["setup"]
    console = out_console()
    console.width = max(console.width, 150)
    where = f"{setup['gpu']} (tp={setup['tp']}, dcp={setup['dcp']}, {setup['dtype']})"
    n = len(setup["seeds"])
    table = Table(
        title=f"E1: {setup['agents']} agents, {setup['model']} (spec {setup['spec']}) on "
        f"simulated {where}; "
        f"{n} paired seed{'s' if n > 1 else ''}, {setup['duration_s']:.0f} s runs "
        f"({setup['warmup_s']:.0f} s warm-up)"
    )
    columns = ["configuration", "jobs/h", *[f"% {b}" for b in bounds]]
    columns += ["p99 ITL ms", "p99 TTFT ms", "hit rate", "preempt", "SLO met"]
    for column in columns:
        table.add_column(column, justify="left" if column == "configuration" else "right")

    def cell(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for label in [*labels, *bounds]:
        m = report[label]
        fractions = report["fraction_of_bound"].get(label, {})
        shares = [
            "-"
            if b not in fractions
            else cell(fractions[b]["mean"] and 100 * fractions[b]["mean"], ".0f")
            for b in bounds
        ]
        name = f"{label} (bound)" if label in bounds else label
        if label == "baseline":
            name = f"baseline ({setup['baseline']})"
        table.add_row(
            name,
            cell(m["job_goodput_per_hour"], ",.1f"),
            *shares,
            cell(m["itl_p99_ms"], ",.1f"),
            cell(m["ttft_p99_ms"], ",.0f"),
            cell(m["prefix_hit_rate"], ".3f"),
            cell(m["preemptions"], ".1f"),
            cell(m["slo_attainment"], ".2f"),
        )
    console.print(table)
    base = setup["baseline"]
    for name, ratio in report["ratios"].items():
        ci = ratio["ci95"]
        interval = (
            "no interval with one seed" if ci is None else f"95% CI [{ci[0]:.2f}, {ci[1]:.2f}]"
        )
        per_seed = ", ".join("-" if v is None else f"{v:.2f}" for v in ratio["per_seed"])
        mean = ratio["mean"]
        shown = "-" if mean is None else f"{mean:.2f}x"
        console.print(
            f"hybridserve / {base} {name}: {shown} ({interval}; per seed {per_seed})",
            highlight=False,
        )
    if n < 10:
        console.print(
            f"{n} seeds: a short screen. The full design (10+ paired seeds, 1,800 s runs) is "
            "benchmarks/e1_matrix.py.",
            highlight=False,
        )
    time_table = Table(title="where the time goes (means over seeds)")
    time_table.add_column("configuration")
    for column in (
        "GPU busy",
        "decode",
        "prefill",
        "mixed",
        "job: decode",
        "tool",
        "queue+TTFT",
        "recomputed/turn",
        "ideal/turn",
    ):
        time_table.add_column(column, justify="right")
    for label in labels:
        m = report[label]
        time_table.add_row(
            label,
            *[cell(m[k], ".2f") for k in BREAKDOWN_ROWS[1:8]],
            *[cell(m[k], ",.0f") for k in BREAKDOWN_ROWS[8:]],
        )
    console.print(time_table)
    for label in labels:
        log = "; ".join(report["pool"][label]["vllm_log"])
        console.print(f"{label} pool (vLLM would log): {log}", highlight=False)
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
    tp: SimTpOption = None,
    dtype: SimDtypeOption = None,
    spec: SpecOption = "auto",
    dcp: DcpOption = 1,
    model_config: ModelConfigOption = None,
    kv_dtype: KvDtypeOption = None,
    agents: AgentsOption = 20,
    duration: DurationOption = 900.0,
    warmup: WarmupOption = 150.0,
    seed: SeedOption = 0,
    space: Annotated[
        str,
        typer.Option(
            help="hybridserve: its controls over predecessor retention; vllm: vLLM's own knobs "
            "(token budget, long-prefill threshold, max_num_seqs, retention) on the baseline."
        ),
    ] = "hybridserve",
    as_json: JsonOption = False,
) -> None:
    """Search the scheduler controls for the best job goodput under a p99 ITL SLO."""
    from hybridserve.sim.run import model_profile, state_quantum
    from hybridserve.sim.sweep import best, sweep, vllm_sweep

    if trials < 1 or workers < 1:
        raise fail(f"--trials={trials} --workers={workers}; use 1 or more of each")
    finished: list[Trial] = []
    tp = tp if tp is not None else dcp
    try:
        config = _sim_config(
            model=model,
            tp=tp,
            spec=spec,
            dcp=dcp,
            num_agents=agents,
            duration_s=duration,
            warmup_s=warmup,
            seed=seed,
            **_model_options(model_config),
            **_device_options(gpu, dtype, kv_dtype, None),
        )
        quantum = state_quantum(model_profile(config))
        if space == "vllm":
            if ray is not None:
                raise ConfigError("--ray", ray, "the vllm space runs in local processes")
            results = vllm_sweep(config, trials=trials, quantum=quantum, workers=workers, seed=seed)
        elif space == "hybridserve":
            results = sweep(
                config,
                trials=trials,
                quantum=quantum,
                workers=workers,
                seed=seed,
                ray_address=ray,
                on_trial=finished.append,
            )
        else:
            raise ConfigError("--space", space, "use hybridserve or vllm")
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        raise _sweep_interrupted(finished, trials + 1, itl_slo_ms) from None
    winner = best(results, itl_slo_ms=itl_slo_ms)
    rows = [
        {
            "controls": dict(t.controls),
            "retention": t.retention,
            **_metrics_json(t.metrics),
            "meets_slo": t.meets(itl_slo_ms),
        }
        for t in results
    ]
    if as_json:
        chosen: dict[str, Any] = dict(winner.controls)
        if space == "vllm":
            chosen = {"controls": dict(winner.controls), "retention": winner.retention}
        payload = {"space": space, "itl_slo_ms": itl_slo_ms, "best": chosen, "trials": rows}
        sys.stdout.write(json.dumps(payload) + "\n")
        return
    table = Table(title=f"sweep: {len(results)} trials, p99 ITL SLO {itl_slo_ms:.0f} ms")
    for column in ("controls", "job goodput/h", "p99 ITL ms", "TTFT p50 ms", "SLO"):
        table.add_column(column, justify="left" if column == "controls" else "right")
    for trial in sorted(results, key=lambda t: -t.metrics["job_goodput_per_hour"]):
        label = ", ".join(f"{k}={v:g}" for k, v in trial.controls if v) or "all off"
        if trial.retention:
            label += f", retention={trial.retention}"
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
