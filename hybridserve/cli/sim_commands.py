"""`hybridserve simulate` and `hybridserve bench` (experiment E1)."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol

import typer
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from hybridserve.cli.app import (
    FINITE_FLOAT,
    app,
    err,
    fail,
    install_hint,
    out_console,
    read_settings_file,
)
from hybridserve.cli.choices import ROUTER_LOAD_WEIGHT
from hybridserve.cli.options import (
    AgentsOption,
    ConfigOption,
    DurationOption,
    FirstSeedOption,
    JsonOption,
    KvDtypeOption,
    LimitOption,
    LoadWeightOption,
    ModelConfigOption,
    NameOption,
    OutOption,
    PdLinkOption,
    PresetOption,
    RouterViewOption,
    SeedOption,
    SimDtypeOption,
    SimGpuOption,
    SimModelOption,
    SimTpOption,
    SpeculationOption,
    TimeScaleOption,
    WarmupOption,
    WorkersOption,
    WorkloadOption,
)
from hybridserve.cli.progress import interrupted, runs_progress
from hybridserve.core.errors import ConfigError, HybridServeError
from hybridserve.metrics.report_keys import BREAKDOWN_KEYS, RUN_KEYS

if TYPE_CHECKING:
    from hybridserve.engine.step_log import StepLog
    from hybridserve.sim.deployment import Deployment, FleetConfig, SimConfig
    from hybridserve.sim.summary import SimRun
    from hybridserve.sim.sweep import Trial

REPORT_KEYS = RUN_KEYS


def _sim_config(*, num_agents: int, **options: Any) -> SimConfig:
    """Import the simulator only when a simulation command runs."""
    from hybridserve.sim.deployment import SimConfig
    from hybridserve.sim.workload import AgentParams

    return SimConfig(agents=AgentParams(num_agents=num_agents), **options)


def _run_sim(
    config: SimConfig,
    *,
    label: str,
    quiet: bool,
    deployment: Deployment | None = None,
    step_log: StepLog | None = None,
) -> SimRun:
    """One run, with a progress bar in simulated seconds on stderr unless `quiet`."""
    from hybridserve.sim.run import run_simulation

    # The measured-CPU option needs a clock; the simulator never reads one itself.
    clock = time.perf_counter if config.include_scheduler_cpu else None
    if quiet:
        return run_simulation(config, cpu_clock=clock, deployment=deployment, step_log=step_log)
    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        TextColumn("{task.completed:.0f} / {task.total:.0f} simulated s"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(label, total=config.duration_s)
        return run_simulation(
            config,
            progress=lambda now: bar.update(task, completed=now),
            cpu_clock=clock,
            deployment=deployment,
            step_log=step_log,
        )


def _file_options(config_file: Path | None, *, preset: str | None = None) -> dict[str, Any]:
    """SimConfig fields of a --config settings file (scheduler fields, cache retention) and
    of --preset: the flag's preset, else the file's, else hybridserve."""
    from hybridserve.engine.settings import preset_name

    loaded = read_settings_file(config_file)
    if loaded is None:
        return {"preset": preset_name(preset, None)}
    return {
        "preset": preset_name(preset, loaded),
        "overrides": loaded.scheduler,
        "retention": loaded.retention,
    }


def _bench_file_options(config_file: Path | None) -> dict[str, Any]:
    """A --config file's scheduler fields and retention for bench's hybridserve side (bench
    picks the presets it compares itself)."""
    options = _file_options(config_file)
    if config_file is not None and options["preset"] != "hybridserve":
        raise ConfigError(
            "preset",
            options["preset"],
            f"bench compares the presets itself; drop `preset` from {config_file} (or run "
            "`hybridserve simulate --config` on it)",
        )
    del options["preset"]
    return options


def _model_options(model_config: Path | None) -> dict[str, Any]:
    """SimConfig fields of --model-config (the parsed model beats --model)."""
    return {} if model_config is None else {"model_config": str(model_config)}


def _device_options(
    gpu: str | None, dtype: str | None, kv_dtype: str | None, calibration: Path | None
) -> dict[str, Any]:
    """SimConfig fields of --gpu, --dtype, --kv-dtype and --calibration. A calibration
    sets the device (its Gpu), the Efficiency constants and, unless given, the dtypes it
    was measured in; a --gpu naming another device is an error."""
    if calibration is None:
        return {"gpu": gpu or "H200", "dtype": dtype or "fp8", "kv_dtype": kv_dtype or "bf16"}
    from hybridserve.sim.calibration import Calibration

    measured = Calibration.load(calibration)
    if gpu is not None and gpu != measured.device:
        raise ConfigError(
            "--gpu",
            gpu,
            f"--calibration {calibration} was measured on {measured.device}; drop --gpu "
            "(the calibration sets the device)",
        )
    return {
        "gpu": measured.device,
        "calibrated_gpu": measured.gpu,
        "efficiency": measured.efficiency,
        "dtype": dtype or measured.dtype,
        "kv_dtype": kv_dtype or measured.kv_dtype,
    }


def run_label(preset: str, config_file: Path | None) -> str:
    """What a run is called in tables, plots and report.json: its preset, and the --config file
    that changed it (a modified baseline is not the baseline)."""
    return preset if config_file is None else f"{preset} + {config_file.name}"


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
    rows = [{"controls": dict(t.overrides), **_metrics_json(t.metrics)} for t in finished]
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
    """Say on stderr what the numbers alone hide: settings the model could not take, rejected
    requests and a queue that never drains."""
    for notice in run.notices:
        err.print(f"note: {notice}", soft_wrap=True, highlight=False)
    if run.rejected:
        shown = ", ".join(
            f"{rid} (request {int(rid[1:]) + 1} of the trace, {length:,} tokens)"
            if rid[1:].isdigit()
            else f"{rid} ({length:,} tokens)"
            for rid, length, _ in run.rejected[:3]
        )
        more = f" and {len(run.rejected) - 3} more" if len(run.rejected) > 3 else ""
        reason = run.rejected[0][2]
        fix = " Raise --max-model-len to keep them." if "max_model_len" in reason else ""
        failed = int(run.summary.get("jobs_failed", 0))
        jobs = (
            f" {failed} agent jobs failed for them (each went on with its drawn answers and "
            "is out of job goodput)."
            if failed
            else ""
        )
        err.print(
            f"warning: {len(run.rejected)} requests were rejected, not run: {shown}{more}; "
            f"{reason}.{fix}{jobs}",
            soft_wrap=True,
        )
    s = run.summary
    if s.get("never_drains"):
        rates = ""
        if s.get("arrival_rate_per_s"):
            rates = (
                f"; requests arrived at {s['arrival_rate_per_s']:.2f}/s and were served at "
                f"{s['service_rate_per_s']:.2f}/s"
            )
        err.print(
            f"warning: the run never drains: the waiting queue grew through the window (mean "
            f"{s['waiting_first_quarter']:.0f} requests in its first quarter, "
            f"{s['waiting_last_quarter']:.0f} in its last){rates}, so arrivals outpace this "
            "configuration and latencies keep growing with the run's length instead of settling. "
            "Lower the "
            "load (--time-scale above 1, fewer --agents) or compare another --preset.",
            soft_wrap=True,
        )


def _simulated_model(config: SimConfig | Deployment) -> tuple[str, str]:
    """(the model's name, the speculative method) that `config` simulates: the profile parsed
    from --model-config when given, and the resolved --spec (auto: from the model)."""
    from hybridserve.sim.deployment import resolve_deployment, speculative_method

    deployment = resolve_deployment(config)
    return deployment.profile.name, speculative_method(
        deployment.config.speculation, deployment.profile
    )


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
    setup = report.get("setup")
    seeds = setup.get("seeds") if isinstance(setup, dict) else None
    if not seeds:
        return [path, *write_plots(folder, runs)]
    from hybridserve.sim.bounds import BOUNDS
    from hybridserve.sim.experiment import goodput_ratios

    ratios = goodput_ratios(report)
    return [
        path,
        *write_plots(folder, runs, goodput_ratios=ratios, ratio_seeds=seeds, bounds=BOUNDS),
    ]


def _metrics_json(summary: dict[str, float]) -> dict[str, float | None]:
    """Rounded values; an undefined statistic (no sample in the window) becomes null."""
    return {k: None if math.isnan(v) else round(v, 4) for k, v in summary.items()}


CalibrationOption = Annotated[
    Path | None,
    typer.Option(
        "--calibration",
        help="A calibration file from `hybridserve calibrate`: its device and fitted cost-model "
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
HostMemoryOption = Annotated[
    float,
    typer.Option(
        parser=FINITE_FLOAT,
        help="Host memory for a host tier of the KV cache, GiB over the engine's TP ranks (as "
        "vLLM's --kv-offloading-size); 0 = none. Evicted blocks (and states) go there and "
        "come back on a hit over the GPU's host link.",
    ),
]
HostOffloadOption = Annotated[
    str,
    typer.Option(
        help="How the host tier fills: evict (what the device evicts) or vllm (vLLM 0.33's "
        "offloading connector: every computed prompt block, written through)."
    ),
]
HOST_OFFLOADS = ("evict", "vllm")
SimStepLogOption = Annotated[
    Path | None,
    typer.Option(
        "--step-log",
        help="Write one JSON line per simulated step here (when it began, its charged seconds, "
        "each scheduled request's new and context tokens), in `serve --step-log`'s form "
        "(benchmarks/step_log_check.py sets the two beside each other). One engine only.",
    ),
]


def host_options(host_memory_gib: float, host_offload: str) -> dict[str, Any]:
    """SimConfig fields of --host-memory-gib and --host-offload."""
    if host_offload not in HOST_OFFLOADS:
        raise ConfigError("--host-offload", host_offload, f"use one of {HOST_OFFLOADS}")
    return {
        "host_memory_gib": host_memory_gib,
        "host_write_through": host_offload == "vllm" and host_memory_gib > 0,
    }


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


SimWarmupOption = Annotated[
    float | None,
    typer.Option(
        parser=FINITE_FLOAT,
        help="Seconds excluded from the metrics [default: 300, or 0 for a workload with a "
        "fixed number of requests: a trace, poisson, fixed with requests=N].",
    ),
]
SimMaxModelLenOption = Annotated[
    int | None,
    typer.Option(
        help="Context limit in tokens; longer trace requests are rejected and counted "
        "[default: 131073, the agents' context limit + 1]."
    ),
]
ReplicasOption = Annotated[
    int | None,
    typer.Option(
        help="Simulate a fleet of N replicas behind --router (adds a `fleet` report) "
        "[default: one engine, no router]."
    ),
]
RouterOption = Annotated[
    str,
    typer.Option(
        help="Fleet router: round-robin, least-loaded, session, prefix-fa (full-attention "
        "overlap) or prefix-hybrid (the reconciled hit)."
    ),
]
PdOption = Annotated[
    str | None,
    typer.Option(
        help="Disaggregate: P:D prefill and decode replicas (P + D = --replicas, which it "
        "implies); KV and state move over --pd-link."
    ),
]


@dataclass(frozen=True, slots=True)
class SimulateFlags:
    """Every `simulate` flag, as given."""

    model: str
    gpu: str | None
    tp: int | None
    dtype: str | None
    dcp: int
    bound: str | None
    preset: str | None
    agents: int
    duration: float
    warmup: float | None
    speculation: str
    workload: str
    time_scale: float
    limit: int | None
    max_model_len: int | None
    config_file: Path | None
    include_scheduler_cpu: bool
    model_config: Path | None
    kv_dtype: str | None
    calibration: Path | None
    out: Path | None
    seed: int
    as_json: bool
    replicas: int | None
    router: str
    router_view: str
    router_load_weight: float
    pd: str | None
    pd_link: str
    host_memory_gib: float
    host_offload: str
    step_log: Path | None

    def config(self) -> SimConfig:
        """The run's SimConfig: the flags, the device, the model and the settings file."""
        return _sim_config(
            model=self.model,
            tp=self.tp if self.tp is not None else self.dcp,
            dcp=self.dcp,
            bound=self.bound,
            num_agents=self.agents,
            duration_s=self.duration,
            warmup_s=_default_warmup(self.workload) if self.warmup is None else self.warmup,
            speculation=self.speculation,
            seed=self.seed,
            workload=self.workload,
            time_scale=self.time_scale,
            limit=self.limit,
            max_model_len=self.max_model_len,
            include_scheduler_cpu=self.include_scheduler_cpu,
            **host_options(self.host_memory_gib, self.host_offload),
            **_model_options(self.model_config),
            **_device_options(self.gpu, self.dtype, self.kv_dtype, self.calibration),
            **_file_options(self.config_file, preset=self.preset),
        )


@app.command("simulate")
def simulate_cmd(
    model: SimModelOption = "qwen3-next-80b-a3b",
    gpu: SimGpuOption = None,
    tp: SimTpOption = None,
    dtype: SimDtypeOption = None,
    dcp: DcpOption = 1,
    bound: BoundOption = None,
    preset: PresetOption = None,
    agents: AgentsOption = 20,
    duration: DurationOption = 1800.0,
    warmup: SimWarmupOption = None,
    speculation: SpeculationOption = "auto",
    workload: WorkloadOption = "agents",
    time_scale: TimeScaleOption = 1.0,
    limit: LimitOption = None,
    max_model_len: SimMaxModelLenOption = None,
    config_file: ConfigOption = None,
    include_scheduler_cpu: CpuOption = False,
    model_config: ModelConfigOption = None,
    kv_dtype: KvDtypeOption = None,
    calibration: CalibrationOption = None,
    out: OutOption = None,
    seed: SeedOption = 0,
    as_json: JsonOption = False,
    replicas: ReplicasOption = None,
    router: RouterOption = "round-robin",
    router_view: RouterViewOption = "precise",
    router_load_weight: LoadWeightOption = ROUTER_LOAD_WEIGHT,
    pd: PdOption = None,
    pd_link: PdLinkOption = "nvlink",
    host_memory_gib: HostMemoryOption = 0.0,
    host_offload: HostOffloadOption = "evict",
    step_log: SimStepLogOption = None,
) -> None:
    """Simulate a workload on a modelled GPU: job goodput, TTFT, ITL, prefix hits."""
    flags = SimulateFlags(**locals())
    try:
        deployment, pool, run, fleet_report = _simulate(flags)
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        raise interrupted("the run did not finish; nothing was written") from None
    _report_simulation(flags, deployment, run, pool, fleet_report)


Simulated = tuple["Deployment", dict[str, Any], "SimRun", dict[str, Any] | None]


def _simulate(flags: SimulateFlags) -> Simulated:
    """One engine, or a fleet behind a router: the deployment (resolved once), its pool, the
    run and, for a fleet, its report."""
    from hybridserve.engine.step_log import StepLog
    from hybridserve.sim.deployment import resolve_deployment
    from hybridserve.sim.run import check_step_log, pool_report

    config = replace(flags.config(), fleet=fleet_option(flags))
    check_step_log(config, flags.step_log)  # before the log's file is opened
    deployment = resolve_deployment(config)  # the model and the preset, resolved once
    pool = pool_report(deployment)  # a pool that does not fit fails before anything runs
    label = run_label(config.preset, flags.config_file)
    opened = StepLog(flags.step_log) if flags.step_log is not None else nullcontext()
    with opened as step_log:
        run = _run_sim(
            config,
            label=f"simulate ({label})",
            quiet=flags.as_json,
            deployment=deployment,
            step_log=step_log,
        )
    return deployment, pool, run, run.fleet


def _report_simulation(
    flags: SimulateFlags,
    deployment: Deployment,
    run: SimRun,
    pool: dict[str, Any],
    fleet_report: dict[str, Any] | None,
) -> None:
    """The run's metrics: as JSON, or as a table (and report.json plus plots with --out)."""
    config = deployment.config
    summary = dict(run.summary)
    summary["kv_cache_tokens"] = float(pool["kv_cache_tokens"])
    summary["max_concurrency"] = float(pool["max_concurrency"])
    _warn_about_run(run)
    name, method = _simulated_model(deployment)
    label = run_label(config.preset, flags.config_file)
    if flags.out is not None:
        setup = {"model": name, "spec": method, "gpu": config.gpu, "workload": flags.workload}
        report: dict[str, object] = {label: _metrics_json(summary), "pool": pool, "setup": setup}
        _write_report(flags.out, report, {label: run})
    if flags.as_json:
        payload: dict[str, Any] = dict(_metrics_json(summary))
        if fleet_report is not None:
            payload["fleet"] = fleet_json(fleet_report)
        sys.stdout.write(json.dumps(payload) + "\n")
        return
    where = f"{config.gpu} (tp={config.tp}, dcp={config.dcp}, {config.dtype})"
    extra = f", bound={flags.bound}" if flags.bound else ""
    console = out_console()
    console.print(f"simulate: {name} (spec {method}) on {where}, {label}{extra}")
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in (*shown_keys(flags.workload), *BREAKDOWN_ROWS):
        value = summary.get(key, math.nan)
        table.add_row(key, "-" if math.isnan(value) else f"{value:,.3f}")
    if summary["requests_rejected"]:
        table.add_row("requests_rejected", f"{summary['requests_rejected']:,.0f}")
    if summary.get("jobs_failed"):
        table.add_row("jobs_failed", f"{summary['jobs_failed']:,.0f}")
    console.print(table)
    if fleet_report is not None:
        console.print(fleet_table(fleet_report))
    for line in pool["vllm_log"]:
        console.print(f"vLLM would log: {line}")


# ----- fleet (hybridserve.sim.fleet) -----------------------------------------------------------


class FleetFlags(Protocol):
    """The fleet options, as `simulate`, `bench` and `sweep` take them."""

    @property
    def replicas(self) -> int | None: ...
    @property
    def router(self) -> str: ...
    @property
    def router_view(self) -> str: ...
    @property
    def router_load_weight(self) -> float: ...
    @property
    def pd(self) -> str | None: ...
    @property
    def pd_link(self) -> str: ...


@dataclass(frozen=True, slots=True)
class _FleetFlags:
    replicas: int | None
    router: str
    router_view: str
    router_load_weight: float
    pd: str | None
    pd_link: str


def fleet_option(flags: FleetFlags) -> FleetConfig | None:
    """The fleet the options ask for, or None for one engine (`sim.deployment.fleet_of`)."""
    from hybridserve.sim.deployment import fleet_of

    return fleet_of(
        replicas=flags.replicas,
        router=flags.router,
        view=flags.router_view,
        load_weight=flags.router_load_weight,
        pd=flags.pd,
        pd_link=flags.pd_link,
    )


def fleet_json(report: dict[str, Any]) -> dict[str, Any]:
    """The fleet report, rounded as the metrics are (an undefined value becomes null)."""
    from hybridserve.sim.summary import rounded

    out: dict[str, Any] = rounded(report)
    return out


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


BREAKDOWN_ROWS = ("slo_attainment", *BREAKDOWN_KEYS)


BaselineOption = Annotated[
    str,
    typer.Option(
        help="What hybridserve is compared with: vllm, vllm-tuned, legacy, vllm-offload or "
        "vllm-tuned-offload (vLLM 0.33, or the tuned vLLM, with its own CPU offloading at "
        "--host-memory-gib)."
    ),
]
SeedsOption = Annotated[
    int,
    typer.Option(help="Paired seeds (seed, seed+1, ...): every configuration sees the same jobs."),
]
# One default for `bench` and `sweep` (and the README's E1 runs): 2 workers, a 100 ms p99 ITL SLO.
DEFAULT_WORKERS = 2
DEFAULT_ITL_SLO_MS = 100.0
# E1's full design, as the README's tables and benchmarks/e1_matrix.py's docstring run it.
E1_DESIGN = "600 s runs with a 120 s warm-up"
E1_DESIGN_FLAGS = "--duration 600 --warmup 120"
TunedOption = Annotated[
    Path | None,
    typer.Option(
        help="--baseline vllm-tuned: the search result to use (the JSON of `sweep --space "
        "vllm --json` or of an earlier bench) instead of searching now."
    ),
]
TuneTrialsOption = Annotated[
    int, typer.Option(help="--baseline vllm-tuned: random vLLM settings to try.")
]
TuneSloOption = Annotated[
    float,
    typer.Option(parser=FINITE_FLOAT, help="--baseline vllm-tuned: the p99 ITL SLO of the search."),
]
BoundsOption = Annotated[
    bool | None,
    typer.Option(
        help="Also run the three upper bounds (on the baseline) [default: on one engine; "
        "bounds are single-engine, so not with a fleet]."
    ),
]
AblationsOption = Annotated[
    bool, typer.Option(help="Also run decode-first and its ablations (controls-, retention-only).")
]
AlsoBaselinesOption = Annotated[
    str,
    typer.Option(
        help="More baselines beside --baseline, comma-separated (vllm, vllm-tuned, legacy, "
        "vllm-offload, vllm-tuned-offload; one tuned one at most): each "
        "runs on the same seeds, with hybridserve's paired ratios to it (`ratios_vs`)."
    ),
]


@dataclass(frozen=True, slots=True)
class BenchFlags:
    """Every `bench` flag, as given."""

    model: str
    gpu: str | None
    tp: int | None
    dtype: str | None
    speculation: str
    dcp: int
    baseline: str
    agents: int
    seeds: int
    duration: float
    warmup: float
    seed: int
    workers: int
    tuned: Path | None
    tune_trials: int
    itl_slo_ms: float
    bounds: bool | None
    config_file: Path | None
    model_config: Path | None
    kv_dtype: str | None
    calibration: Path | None
    name: str | None
    ablations: bool
    also_baselines: str
    as_json: bool
    replicas: int | None
    router: str
    router_view: str
    router_load_weight: float
    pd: str | None
    pd_link: str
    host_memory_gib: float

    @property
    def seed_list(self) -> list[int]:
        return list(range(self.seed, self.seed + self.seeds))

    @property
    def other_baselines(self) -> list[str]:
        """The --also-baselines names, checked: known, not --baseline, each once."""
        from hybridserve.sim.experiment import BASELINES

        names = [n.strip() for n in self.also_baselines.split(",") if n.strip()]
        for name in names:
            if name not in BASELINES:
                raise ConfigError("--also-baselines", name, f"use some of {', '.join(BASELINES)}")
            if name == self.baseline or names.count(name) > 1:
                raise ConfigError(
                    "--also-baselines", name, "name each baseline once, other than --baseline"
                )
        tuned = [n for n in (self.baseline, *names) if n in ("vllm-tuned", "vllm-tuned-offload")]
        if len(tuned) > 1:
            raise ConfigError(
                "--also-baselines", tuned[-1], f"compare with one tuned vLLM at a time: {tuned}"
            )
        return names

    @property
    def labels(self) -> list[str]:
        extra = ["decode-first", "controls-only", "retention-only"] if self.ablations else []
        return ["baseline", "hybridserve", *self.other_baselines, *extra]


@app.command("bench")
def bench_cmd(
    model: SimModelOption = "qwen3-next-80b-a3b",
    gpu: SimGpuOption = None,
    tp: SimTpOption = None,
    dtype: SimDtypeOption = None,
    speculation: SpeculationOption = "auto",
    dcp: DcpOption = 1,
    baseline: BaselineOption = "vllm",
    agents: AgentsOption = 20,
    seeds: SeedsOption = 3,
    duration: DurationOption = 480.0,
    warmup: WarmupOption = 120.0,
    seed: FirstSeedOption = 0,
    workers: WorkersOption = DEFAULT_WORKERS,
    tuned: TunedOption = None,
    tune_trials: TuneTrialsOption = 16,
    itl_slo_ms: TuneSloOption = DEFAULT_ITL_SLO_MS,
    bounds: BoundsOption = None,
    config_file: ConfigOption = None,
    model_config: ModelConfigOption = None,
    kv_dtype: KvDtypeOption = None,
    calibration: CalibrationOption = None,
    name: NameOption = None,
    ablations: AblationsOption = False,
    also_baselines: AlsoBaselinesOption = "",
    as_json: JsonOption = False,
    replicas: ReplicasOption = None,
    router: RouterOption = "round-robin",
    router_view: RouterViewOption = "precise",
    router_load_weight: LoadWeightOption = ROUTER_LOAD_WEIGHT,
    pd: PdOption = None,
    pd_link: PdLinkOption = "nvlink",
    host_memory_gib: HostMemoryOption = 0.0,
) -> None:
    """Experiment E1: a baseline against hybridserve on paired seeds, with 95% intervals, the
    upper bounds and where the time goes (on one engine, or every configuration on the fleet
    --replicas/--pd name)."""
    flags = BenchFlags(**locals())
    from hybridserve.sim.bounds import BOUNDS

    if seeds < 1 or workers < 1:
        raise fail(f"--seeds={seeds} --workers={workers}; use 1 or more of each")
    folder = bench_folder(name)
    finished: dict[str, dict[int, dict[str, float]]] = {}
    try:
        report, results, kept = _bench(flags, finished)
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        raise _bench_interrupted(finished, folder) from None
    plotted = {label: kept[label] for label in flags.labels if label in kept}
    files = _write_report(folder, report, plotted)
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
        return
    _print_bench(report, flags.labels, [b for b in BOUNDS if b in results], files)


def _bench_configs(flags: BenchFlags) -> tuple[SimConfig, dict[str, SimConfig], str]:
    """The common config, each label's config and the baseline's preset."""
    from hybridserve.sim.experiment import baseline_preset
    from hybridserve.sim.run import with_preset

    base_preset = baseline_preset(flags.baseline)
    config = _sim_config(
        model=flags.model,
        tp=flags.tp if flags.tp is not None else flags.dcp,
        speculation=flags.speculation,
        dcp=flags.dcp,
        num_agents=flags.agents,
        duration_s=flags.duration,
        warmup_s=flags.warmup,
        seed=flags.seed,
        fleet=fleet_option(flags),
        **_model_options(flags.model_config),
        **_device_options(flags.gpu, flags.dtype, flags.kv_dtype, flags.calibration),
    )
    presets = {"baseline": base_preset, "hybridserve": "hybridserve"}
    presets.update({p: p for p in flags.labels[2:]})
    others = flags.other_baselines
    presets.update({name: baseline_preset(name, field="--also-baselines") for name in others})
    # A --config file shapes the hybridserve side only: the baselines stay what they are.
    extra = _bench_file_options(flags.config_file)
    configs = {
        label: replace(
            with_preset(config, presets[label]),
            **(extra if label != "baseline" and label not in others else {}),
            **_bench_host(flags, label),
        )
        for label in flags.labels
    }
    return config, configs, base_preset


def _bench_host(flags: BenchFlags, label: str) -> dict[str, Any]:
    """A label's host tier under --host-memory-gib: hybridserve's tier (what the device
    evicts), vLLM's offloading for `vllm-offload`, none for the other vLLM baselines."""
    name = flags.baseline if label == "baseline" else label
    if name in ("vllm-offload", "vllm-tuned-offload"):
        return {"host_memory_gib": flags.host_memory_gib, "host_write_through": True}
    if label == "baseline" or label in flags.other_baselines:
        return {}
    return {"host_memory_gib": flags.host_memory_gib}


def _bench(
    flags: BenchFlags, finished: dict[str, dict[int, dict[str, float]]]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, SimRun]]:
    """Run every configuration on the paired seeds: the report, the results, the kept runs."""
    from hybridserve.sim.bounds import BOUNDS
    from hybridserve.sim.experiment import fleet_block, paired_report, run_configs
    from hybridserve.sim.run import pool_report

    config, configs, base_preset = _bench_configs(flags)
    if flags.bounds and config.fleet is not None:
        raise ConfigError(
            "--bounds", True, "bounds are single-engine: drop --bounds or the fleet options"
        )
    search: dict[str, Any] | None = None
    tuned_label = _tuned_label(flags)
    if tuned_label is not None:
        configs[tuned_label], search = _tuned_baseline(
            configs[tuned_label],
            flags.tuned,
            trials=flags.tune_trials,
            slo=flags.itl_slo_ms,
            workers=flags.workers,
        )
        if not flags.as_json:
            err.print(f"vllm-tuned: {search['best']}", highlight=False)
    if flags.bounds is not False and config.fleet is None:
        for bound in BOUNDS:
            configs[bound] = replace(configs["baseline"], bound=bound)
    pools = {label: pool_report(configs[label]) for label in flags.labels}
    simulated = _simulated_model(config)
    seed_list = flags.seed_list
    fleets: dict[str, dict[int, dict[str, Any]]] = {}
    with runs_progress(len(configs) * len(seed_list), quiet=flags.as_json) as log:
        results, kept = run_configs(
            configs,
            seed_list,
            workers=flags.workers,
            keep_seed=seed_list[0],
            log=log,
            finished=finished,
            fleets=fleets,
        )
    report = paired_report(results, baseline="baseline", ours="hybridserve")
    report["ratios_vs"] = {
        name: paired_report(
            {k: results[k] for k in (name, "hybridserve")},
            baseline=name,
            ours="hybridserve",
            bounds=(),
        )["ratios"]
        for name in flags.other_baselines
    }
    if fleets:
        report["fleet"] = fleet_block({k: [v[s] for s in seed_list] for k, v in fleets.items()})
    report["pool"] = pools
    report["setup"] = _bench_setup(flags, config, simulated, base_preset, search)
    return report, results, kept


def _tuned_label(flags: BenchFlags) -> str | None:
    """The label of the tuned vLLM baseline, main or another one (one at most), if any."""
    tuned = ("vllm-tuned", "vllm-tuned-offload")
    if flags.baseline in tuned:
        return "baseline"
    return next((name for name in tuned if name in flags.other_baselines), None)


def _bench_setup(
    flags: BenchFlags,
    config: SimConfig,
    simulated: tuple[str, str],
    base_preset: str,
    search: dict[str, Any] | None,
) -> dict[str, Any]:
    """The report's `setup`: what was compared, on what, for how long."""
    config_file, labels = flags.config_file, flags.labels
    return {
        "model": simulated[0],
        "spec": simulated[1],
        "gpu": config.gpu,
        "tp": config.tp,
        "dcp": flags.dcp,
        "dtype": config.dtype,
        "kv_dtype": config.kv_dtype,
        "baseline": flags.baseline,
        "baseline_preset": base_preset,
        "model_config": None if flags.model_config is None else str(flags.model_config),
        "calibration": None if flags.calibration is None else str(flags.calibration),
        "agents": flags.agents,
        "duration_s": flags.duration,
        "warmup_s": flags.warmup,
        "seeds": flags.seed_list,
        "vllm_tuned": search,
        "config": None if config_file is None else str(config_file),
        # A --config file shapes the hybridserve side only: the baseline stays what it is.
        "labels": {
            label: label
            if label == "baseline" or label in flags.other_baselines
            else run_label(label, config_file)
            for label in labels
        },
        "also_baselines": flags.other_baselines,
    }


def _tuned_baseline(
    config: SimConfig, tuned: Path | None, *, trials: int, slo: float, workers: int
) -> tuple[SimConfig, dict[str, Any]]:
    """The vllm-tuned baseline: from a stored search result, or searched now."""
    from hybridserve.sim.experiment import read_tuned, tune_vllm

    if tuned is None:
        return tune_vllm(config, trials=trials, itl_slo_ms=slo, workers=workers, seed=config.seed)
    return read_tuned(config, tuned)


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _print_bench(
    report: dict[str, Any], labels: list[str], bounds: list[str], files: list[Path]
) -> None:
    console = out_console()
    console.width = max(console.width, 150)
    console.print(_bench_table(report, labels, bounds))
    _print_ratios(console, report)
    console.print(_time_table(report, labels))
    if "fleet" in report:
        console.print(_bench_fleet_table(report["fleet"], labels))
    for label in labels:
        log = "; ".join(report["pool"][label]["vllm_log"])
        console.print(f"{label} pool (vLLM would log): {log}", highlight=False)
    console.print("files: " + ", ".join(str(f) for f in files))


def _bench_table(report: dict[str, Any], labels: list[str], bounds: list[str]) -> Table:
    """One row per configuration (and bound): goodput, its share of each bound, latency."""
    setup = report["setup"]
    cell = _cell
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
    return table


def _bench_fleet_table(fleet: dict[str, Any], labels: list[str]) -> Table:
    """The fleet block: per configuration, hit rate against the global ideal, imbalance and
    goodput per GPU (means over seeds)."""
    layout = (
        "colocated"
        if fleet["pd"] is None
        else f"P:D {fleet['pd']['prefill']}:"
        + (f"{fleet['pd']['decode']} over {fleet['pd']['link']}")
    )
    table = Table(
        title=f"fleet: {fleet['replicas']} replicas ({fleet['gpus']} GPUs, {layout}), router "
        f"{fleet['router']} ({fleet['router_view']}, load weight {fleet['load_weight']:g}); "
        "means over seeds"
    )
    columns = {
        "hit rate": ("hit_rate", ".3f"),
        "global ideal": ("global_ideal_hit_rate", ".3f"),
        "of ideal": ("hit_rate_of_ideal", ".0%"),
        "imbalance": ("imbalance", ".2f"),
        "SLO req/GPU-h": ("slo_requests_per_gpu_hour", ",.1f"),
        "jobs/GPU-h": ("job_goodput_per_gpu_hour", ",.1f"),
    }
    table.add_column("configuration")
    for column in columns:
        table.add_column(column, justify="right")
    for label in labels:
        m = fleet["configurations"][label]
        table.add_row(label, *[_cell(m[key], fmt) for key, fmt in columns.values()])
    return table


def _print_ratios(console: Any, report: dict[str, Any]) -> None:
    """hybridserve over the baseline per metric, with its interval and per-seed values."""
    from hybridserve.sim.stats import describe_ratio

    setup = report["setup"]
    n = len(setup["seeds"])
    base = setup["baseline"]
    console.print(
        "paired ratios: geometric mean of per-seed ratios [95% t interval, log scale]",
        highlight=False,
    )
    for name, ratio in report["ratios"].items():
        per_seed = ", ".join("-" if v is None else f"{v:.2f}" for v in ratio["per_seed"])
        console.print(
            f"hybridserve / {base} {name}: {describe_ratio(ratio)}; per seed {per_seed}",
            highlight=False,
        )
    for other, ratios in report.get("ratios_vs", {}).items():
        parts = [f"{name} {describe_ratio(ratio)}" for name, ratio in ratios.items()]
        console.print(f"hybridserve / {other}: " + "; ".join(parts), highlight=False)
    if n < 10:
        console.print(
            f"{n} seeds: a short screen. The full design (10 paired seeds, {E1_DESIGN}) is "
            f"python benchmarks/e1_matrix.py --seeds 10 {E1_DESIGN_FLAGS} --workers 2.",
            highlight=False,
        )


def _time_table(report: dict[str, Any], labels: list[str]) -> Table:
    """Where the time goes, per configuration (means over seeds)."""
    cell = _cell
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
    return time_table


SweepTrialsOption = Annotated[
    int, typer.Option(help="Random control settings to try (plus all-off).")
]
RayOption = Annotated[
    str | None,
    typer.Option(
        "--ray",
        help="Run trials on a Ray cluster: auto, ray://HOST:10001, or local (needs the ray extra).",
    ),
]
SloOption = Annotated[float, typer.Option(parser=FINITE_FLOAT, help="p99 ITL SLO in milliseconds.")]
SpaceOption = Annotated[
    str,
    typer.Option(
        help="hybridserve: its controls over predecessor retention; vllm: vLLM's own knobs "
        "(token budget, long-prefill threshold, max_num_seqs, retention) on the baseline."
    ),
]


@app.command("sweep")
def sweep_cmd(
    trials: SweepTrialsOption = 8,
    workers: WorkersOption = DEFAULT_WORKERS,
    ray: RayOption = None,
    itl_slo_ms: SloOption = DEFAULT_ITL_SLO_MS,
    model: SimModelOption = "qwen3-next-80b-a3b",
    gpu: SimGpuOption = None,
    tp: SimTpOption = None,
    dtype: SimDtypeOption = None,
    speculation: SpeculationOption = "auto",
    dcp: DcpOption = 1,
    model_config: ModelConfigOption = None,
    kv_dtype: KvDtypeOption = None,
    agents: AgentsOption = 20,
    duration: DurationOption = 900.0,
    warmup: WarmupOption = 150.0,
    seed: SeedOption = 0,
    space: SpaceOption = "hybridserve",
    as_json: JsonOption = False,
    replicas: ReplicasOption = None,
    router: RouterOption = "round-robin",
    router_view: RouterViewOption = "precise",
    router_load_weight: LoadWeightOption = ROUTER_LOAD_WEIGHT,
    pd: PdOption = None,
    pd_link: PdLinkOption = "nvlink",
) -> None:
    """Search the scheduler controls for the best job goodput under a p99 ITL SLO (on one
    engine, or every trial on the fleet --replicas/--pd name)."""
    if trials < 1 or workers < 1:
        raise fail(f"--trials={trials} --workers={workers}; use 1 or more of each")
    finished: list[Trial] = []
    fleet_flags = _FleetFlags(replicas, router, router_view, router_load_weight, pd, pd_link)
    try:
        config = _sim_config(
            fleet=fleet_option(fleet_flags),
            model=model,
            tp=tp if tp is not None else dcp,
            speculation=speculation,
            dcp=dcp,
            num_agents=agents,
            duration_s=duration,
            warmup_s=warmup,
            seed=seed,
            **_model_options(model_config),
            **_device_options(gpu, dtype, kv_dtype, None),
        )
        results = _sweep_trials(
            config, space, trials=trials, workers=workers, ray=ray, on_trial=finished.append
        )
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        raise _sweep_interrupted(finished, trials + 1, itl_slo_ms) from None
    _report_sweep(results, space, itl_slo_ms, as_json=as_json)


def _sweep_trials(
    config: SimConfig,
    space: str,
    *,
    trials: int,
    workers: int,
    ray: str | None,
    on_trial: Callable[[Trial], None],
) -> list[Trial]:
    """The trials of the `space` search (each also passed to `on_trial` as it finishes)."""
    from hybridserve.sim.deployment import model_profile, state_quantum
    from hybridserve.sim.sweep import sweep, vllm_sweep

    quantum = state_quantum(model_profile(config))
    if space == "vllm":
        if ray is not None:
            raise ConfigError("--ray", ray, "the vllm space runs in local processes")
        return vllm_sweep(config, trials=trials, quantum=quantum, workers=workers, seed=config.seed)
    if space == "hybridserve":
        return sweep(
            config,
            trials=trials,
            quantum=quantum,
            workers=workers,
            seed=config.seed,
            ray_address=ray,
            on_trial=on_trial,
        )
    raise ConfigError("--space", space, "use hybridserve or vllm")


_SWEEP_FLEET_CELLS = (("hit_rate", ".3f"), ("hit_rate_of_ideal", ".0%"), ("imbalance", ".2f"))


def _report_sweep(results: list[Trial], space: str, itl_slo_ms: float, *, as_json: bool) -> None:
    """The trials and the best one under the SLO: as JSON, or as a table."""
    from hybridserve.sim.sweep import best

    winner = best(results, itl_slo_ms=itl_slo_ms)
    on_fleet = results[0].fleet is not None
    if as_json:
        rows = [
            {
                "controls": dict(t.overrides),
                "retention": t.retention,
                **_metrics_json(t.metrics),
                "meets_slo": t.meets(itl_slo_ms),
                **({"fleet": fleet_json(t.fleet)} if t.fleet is not None else {}),
            }
            for t in results
        ]
        chosen: dict[str, Any] = dict(winner.overrides)
        if space == "vllm":
            chosen = {"controls": dict(winner.overrides), "retention": winner.retention}
        payload = {"space": space, "itl_slo_ms": itl_slo_ms, "best": chosen, "trials": rows}
        sys.stdout.write(json.dumps(payload) + "\n")
        return
    table = Table(title=f"sweep: {len(results)} trials, p99 ITL SLO {itl_slo_ms:.0f} ms")
    columns = ["controls", "job goodput/h", "p99 ITL ms", "TTFT p50 ms", "SLO"]
    if on_fleet:
        columns += ["fleet hit rate", "of ideal", "imbalance"]
    for column in columns:
        table.add_column(column, justify="left" if column == "controls" else "right")
    for trial in sorted(results, key=lambda t: -t.metrics["job_goodput_per_hour"]):
        label = ", ".join(f"{k}={v:g}" for k, v in trial.overrides if v) or "all off"
        if trial.retention:
            label += f", retention={trial.retention}"
        m, f = trial.metrics, fleet_json(trial.fleet or {})
        extra = [_cell(f.get(k), fmt) for k, fmt in _SWEEP_FLEET_CELLS] if on_fleet else []
        table.add_row(
            label,
            f"{m['job_goodput_per_hour']:.1f}",
            f"{m['itl_p99_ms']:.1f}",
            f"{m['ttft_p50_ms']:.0f}",
            "yes" if trial.meets(itl_slo_ms) else "no",
            *extra,
        )
    console = out_console()
    if on_fleet:
        console.width = max(console.width, 140)
        fleet = results[0].fleet or {}
        console.print(
            f"every trial on a fleet: {fleet['replicas']} replicas, router {fleet['router']} "
            f"({fleet['router_view']})",
            highlight=False,
        )
    console.print(table)
    console.print(f"best under the SLO: {dict(winner.overrides) or 'all off'}")
