"""`hybridserve fleet-sweep`: the grid replicas x router x P:D x preset
(hybridserve.sim.fleet_sweep), run here or on Ray, as a table, fleet_sweep.json and a plot."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hybridserve.cli.app import FINITE_FLOAT, app, err, fail, install_hint, out_console
from hybridserve.cli.choices import ROUTER_LOAD_WEIGHT
from hybridserve.cli.options import (
    AgentsOption,
    DurationOption,
    JsonOption,
    KvDtypeOption,
    LimitOption,
    LoadWeightOption,
    PdLinkOption,
    RouterViewOption,
    SeedOption,
    SimDtypeOption,
    SimGpuOption,
    SimModelOption,
    SimTpOption,
    SpeculationOption,
    TimeScaleOption,
    WorkersOption,
    WorkloadOption,
)
from hybridserve.cli.progress import interrupted
from hybridserve.core.errors import ConfigError, HybridServeError

if TYPE_CHECKING:
    from hybridserve.sim.deployment import SimConfig
    from hybridserve.sim.fleet_sweep import FleetOptions, FleetPoint

ReplicasListOption = Annotated[
    str, typer.Option("--replicas", help="Colocated fleet sizes, comma-separated (none: '').")
]
RoutersOption = Annotated[
    str,
    typer.Option(
        help="Routers, comma-separated: round-robin, least-loaded, session, prefix-fa, "
        "prefix-hybrid."
    ),
]
PdListOption = Annotated[
    str,
    typer.Option(
        "--pd",
        help="Disaggregated splits P:D, comma-separated, each run at P + D replicas "
        "[default: none].",
    ),
]
PresetsOption = Annotated[
    str,
    typer.Option(
        help="Presets (the scheduler controls), comma-separated, e.g. baseline,hybridserve."
    ),
]
AgentsPerGpuOption = Annotated[
    int | None,
    typer.Option(
        help="Agents per GPU: the load grows with the fleet [default: --agents at every point]."
    ),
]
FleetRayOption = Annotated[
    str | None,
    typer.Option(
        "--ray",
        help="Run the points as tasks on a Ray cluster: auto, ray://HOST:10001, or local "
        "(needs the ray extra).",
    ),
]
FleetWarmupOption = Annotated[
    float | None,
    typer.Option(
        parser=FINITE_FLOAT,
        help="Seconds excluded from the metrics [default: 120, or a fifth of a shorter "
        "--duration; 0 for a workload with a fixed number of requests].",
    ),
]
FleetOutOption = Annotated[
    Path | None,
    typer.Option(
        "--out",
        help="Folder for fleet_sweep.json and fleet_sweep.png "
        "[default: a new runs/fleet-sweep-DATE-TIME].",
    ),
]


@dataclass(frozen=True, slots=True)
class FleetSweepFlags:
    """Every `fleet-sweep` flag, as given."""

    replicas: str
    routers: str
    pd: str
    presets: str
    router_view: str
    router_load_weight: float
    pd_link: str
    workers: int
    ray: str | None
    model: str
    gpu: str | None
    tp: int | None
    dtype: str | None
    speculation: str
    kv_dtype: str | None
    workload: str
    limit: int | None
    time_scale: float
    agents: int
    agents_per_gpu: int | None
    duration: float
    warmup: float | None
    seed: int
    out: Path | None
    as_json: bool


@app.command("fleet-sweep")
def fleet_sweep_cmd(
    replicas: ReplicasListOption = "1,2,4",
    routers: RoutersOption = "round-robin,prefix-hybrid",
    pd: PdListOption = "",
    presets: PresetsOption = "hybridserve",
    router_view: RouterViewOption = "precise",
    router_load_weight: LoadWeightOption = ROUTER_LOAD_WEIGHT,
    pd_link: PdLinkOption = "nvlink",
    workers: WorkersOption = 1,
    ray: FleetRayOption = None,
    model: SimModelOption = "qwen3-next-80b-a3b",
    gpu: SimGpuOption = None,
    tp: SimTpOption = None,
    dtype: SimDtypeOption = None,
    speculation: SpeculationOption = "auto",
    kv_dtype: KvDtypeOption = None,
    workload: WorkloadOption = "agents",
    limit: LimitOption = None,
    time_scale: TimeScaleOption = 1.0,
    agents: AgentsOption = 20,
    agents_per_gpu: AgentsPerGpuOption = None,
    duration: DurationOption = 600.0,
    warmup: FleetWarmupOption = None,
    seed: SeedOption = 0,
    out: FleetOutOption = None,
    as_json: JsonOption = False,
) -> None:
    """Fleet shapes on one workload: replicas x router x P:D x preset, each a fleet run; goodput
    per GPU at the SLO, hit rate against the global ideal, imbalance; a table and a plot."""
    flags = FleetSweepFlags(**locals())
    if workers < 1:
        raise fail(f"--workers={workers}; use 1 or more")
    try:
        base, points, options = _fleet_grid(flags)
        rows = _run_grid(base, points, options, flags)
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        raise interrupted("the sweep did not finish; nothing was written") from None
    setup = _setup(flags, base, options)
    folder = flags.out or _new_folder()
    files = _write(folder, setup, rows)
    if as_json:
        sys.stdout.write(json.dumps({"setup": setup, "rows": rows, "files": files}) + "\n")
        return
    console = out_console()
    console.width = max(console.width, 160)
    console.print(fleet_sweep_table(setup, rows))
    console.print("files: " + ", ".join(files), highlight=False)


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _counts(text: str) -> list[int]:
    try:
        return [int(part) for part in _names(text)]
    except ValueError:
        raise ConfigError(
            "replicas (--replicas)", text, "give replica counts separated by commas, e.g. 1,2,4"
        ) from None


def _fleet_grid(flags: FleetSweepFlags) -> tuple[SimConfig, list[FleetPoint], FleetOptions]:
    """The base config (workload, model, device, seed), the grid's points and what they share."""
    from hybridserve.sim.deployment import SimConfig
    from hybridserve.sim.fleet_sweep import FleetOptions, fleet_grid
    from hybridserve.sim.pd import parse_pd
    from hybridserve.sim.run import finite_workload
    from hybridserve.sim.workload import AgentParams

    warmup = flags.warmup
    if warmup is None:
        warmup = 0.0 if finite_workload(flags.workload) else min(120.0, flags.duration / 5)
    base = SimConfig(
        model=flags.model,
        gpu=flags.gpu or "H200",
        tp=flags.tp or 1,
        dtype=flags.dtype or "fp8",
        kv_dtype=flags.kv_dtype or "bf16",
        speculation=flags.speculation,
        workload=flags.workload,
        limit=flags.limit,
        time_scale=flags.time_scale,
        agents=AgentParams(num_agents=flags.agents),
        duration_s=flags.duration,
        warmup_s=warmup,
        seed=flags.seed,
    )
    points = fleet_grid(
        replicas=_counts(flags.replicas),
        routers=_names(flags.routers),
        pd=[parse_pd(split) for split in _names(flags.pd)],
        presets=_names(flags.presets),
    )
    options = FleetOptions(
        view=flags.router_view,
        load_weight=flags.router_load_weight,
        pd_link=flags.pd_link,
        agents_per_gpu=flags.agents_per_gpu,
    )
    return base, points, options


def _run_grid(
    base: SimConfig, points: list[FleetPoint], options: FleetOptions, flags: FleetSweepFlags
) -> list[dict[str, Any]]:
    """Every point, with a progress bar of points done on stderr unless --json."""
    from hybridserve.sim.fleet_sweep import fleet_sweep

    where = "on Ray" if flags.ray is not None else f"{flags.workers} local process(es)"
    if flags.as_json:
        return fleet_sweep(base, points, options, workers=flags.workers, ray_address=flags.ray)
    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("fleet runs"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(f"fleet-sweep ({where})", total=len(points))
        return fleet_sweep(
            base,
            points,
            options,
            workers=flags.workers,
            ray_address=flags.ray,
            on_point=lambda: bar.advance(task),
        )


def _setup(flags: FleetSweepFlags, base: SimConfig, options: FleetOptions) -> dict[str, Any]:
    """What every point shared: workload, model, device, window, seed, router view, link."""
    from hybridserve.sim.deployment import model_profile, speculative_method

    profile = model_profile(base)
    return {
        "model": profile.name,
        "spec": speculative_method(base.speculation, profile),
        "gpu": base.gpu,
        "tp": base.tp,
        "dtype": base.dtype,
        "workload": base.workload,
        "agents": None if options.agents_per_gpu is not None else base.agents.num_agents,
        "agents_per_gpu": options.agents_per_gpu,
        "duration_s": base.duration_s,
        "warmup_s": base.warmup_s,
        "seed": base.seed,
        "router_view": options.view,
        "load_weight": options.load_weight,
        "pd_link": options.pd_link,
        "slo": "TTFT <= 15 s and p99 time between tokens <= 100 ms per request",
    }


def _new_folder(now: float | None = None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    folder, n = Path("runs") / f"fleet-sweep-{stamp}", 1
    while folder.exists():
        n += 1
        folder = Path("runs") / f"fleet-sweep-{stamp}-{n}"
    return folder


def _write(folder: Path, setup: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """fleet_sweep.json and, with matplotlib, fleet_sweep.png; their paths."""
    from hybridserve.metrics.plots import plots_available, write_fleet_sweep_plot

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "fleet_sweep.json"
    path.write_text(json.dumps({"setup": setup, "rows": rows}, indent=2) + "\n")
    if not plots_available():
        err.print(
            f"plot skipped: matplotlib is not installed ({install_hint('sim')})", markup=False
        )
        return [str(path)]
    plot = write_fleet_sweep_plot(folder / "fleet_sweep.png", rows, seed=setup.get("seed"))
    return [str(path), str(plot)]


_COLUMNS = {
    "GPUs": ("gpus", "d"),
    "agents": ("agents", "d"),
    "SLO req/GPU-h": ("slo_requests_per_gpu_hour", ",.1f"),
    "jobs/GPU-h": ("job_goodput_per_gpu_hour", ",.1f"),
    "SLO met": ("slo_attainment", ".3f"),
    "hit rate": ("hit_rate", ".3f"),
    "global ideal": ("global_ideal_hit_rate", ".3f"),
    "of ideal": ("hit_rate_of_ideal", ".0%"),
    "imbalance": ("imbalance", ".2f"),
    "p99 ITL ms": ("itl_p99_ms", ",.1f"),
    "TTFT p50 ms": ("ttft_p50_ms", ",.0f"),
}


def fleet_sweep_table(setup: dict[str, Any], rows: list[dict[str, Any]]) -> Table:
    """One row per fleet shape, in the grid's order."""
    presets = len({r["preset"] for r in rows}) > 1
    table = Table(
        title=f"fleet-sweep: {setup['model']} on simulated {setup['gpu']} (tp={setup['tp']}), "
        f"{setup['workload']}, {setup['duration_s']:.0f} s ({setup['warmup_s']:.0f} s warm-up), "
        f"seed {setup['seed']}; SLO: {setup['slo']}"
    )
    head = ["preset"] if presets else []
    for column in [*head, "router", "layout", *_COLUMNS]:
        table.add_column(column, justify="left" if column in ("preset", "router") else "right")
    for r in rows:
        cells = ["-" if r[k] is None else format(r[k], fmt) for k, fmt in _COLUMNS.values()]
        table.add_row(*([r["preset"]] if presets else []), r["router"], r["layout"], *cells)
    return table
