"""`hybridserve calibrate`: fit the cost model's constants to step times measured on a device."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hybridserve.cli.app import FINITE_FLOAT, MODELS_EXTRA, app, err, fail, need_extra, out_console
from hybridserve.cli.choices import GPU_NAMES, listed
from hybridserve.core.errors import HybridServeError

if TYPE_CHECKING:
    from hybridserve.sim.calibration import Calibration, ErrorSummary

ModelOption = Annotated[Path, typer.Option(help="Checkpoint folder (config.json + safetensors).")]
GpuNameOption = Annotated[
    str,
    typer.Option(
        help=f"The device's name: a catalog GPU ({listed(GPU_NAMES)}) keeps its datasheet "
        "peaks; any other name (e.g. cpu) gets measured peaks."
    ),
]
DeviceOption = Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")]
OutOption = Annotated[
    Path | None, typer.Option(help="Profile file [default: runs/calibration/NAME.json].")
]
QuickOption = Annotated[bool, typer.Option(help="A small grid (about 10 s on a CPU).")]
SeedOption = Annotated[int, typer.Option(help="Seed of the token ids and the held-out split.")]
HoldoutOption = Annotated[
    float,
    typer.Option(
        parser=FINITE_FLOAT, help="Share of the step shapes held out of the fit, in [0, 1)."
    ),
]
ThreadsOption = Annotated[
    int | None, typer.Option(help="torch intra-op threads [default: torch's choice].")
]
ClockOption = Annotated[
    str,
    typer.Option(
        help="wall (perf_counter), or cpu: the thread's CPU time, for a shared machine "
        "(--device cpu --threads 1)."
    ),
]


def _summary_tables(profile: Calibration) -> tuple[Table, Table]:
    eff, gpu = profile.efficiency, profile.gpu
    fp32 = "-" if gpu.fp32_flops is None else f"{gpu.fp32_flops / 1e12:.3f} TFLOP/s"
    summary = Table(title=f"calibration: {profile.model} ({profile.dtype}) on {profile.device}")
    summary.add_column("item")
    summary.add_column("value", justify="right")
    rows = [
        (f"peaks ({profile.peaks})", f"bf16 {gpu.bf16_flops / 1e12:.3f} TFLOP/s, fp32 {fp32}"),
        ("memory bandwidth", f"{gpu.hbm_bytes_per_s / 1e9:.1f} GB/s"),
        ("clock, threads", f"{profile.clock}, {profile.num_threads}"),
        ("gemm", f"{eff.gemm:.3f}"),
        ("attention", f"{eff.attention:.3f}"),
        ("hbm", f"{eff.hbm:.3f}"),
        ("step_overhead", f"{eff.step_overhead_s * 1e3:.3f} ms"),
        ("in-sample |error|", _errors(profile.in_sample)),
        ("held-out |error|", "-" if profile.held_out is None else _errors(profile.held_out)),
    ]
    for row in rows:
        summary.add_row(*row)
    samples = Table(title="measured steps")
    for column in ("step", "measured ms", "predicted ms", "error", "held out"):
        samples.add_column(column, justify="left" if column == "step" else "right")
    for s in profile.samples:
        samples.add_row(
            s.label,
            f"{s.measured_s * 1e3:.2f}",
            f"{s.predicted_s * 1e3:.2f}",
            f"{s.relative_error:+.1%}",
            "yes" if s.held_out else "",
        )
    return summary, samples


def _errors(summary: ErrorSummary) -> str:
    return f"median {summary.median:.1%}, max {summary.max:.1%} ({summary.num_samples} steps)"


@app.command("calibrate")
def calibrate_cmd(
    model: ModelOption,
    gpu_name: GpuNameOption,
    device: DeviceOption = "cpu",
    out: OutOption = None,
    quick: QuickOption = False,
    seed: SeedOption = 0,
    holdout_fraction: HoldoutOption = 0.25,
    threads: ThreadsOption = None,
    clock: ClockOption = "wall",
) -> None:
    """Measure step times on a device, fit the cost model's constants, write a calibration file for
    `hybridserve simulate --calibration FILE`."""
    from hybridserve.sim.calibration_fit import QUICK_GRID, Grid

    need_extra("models", *MODELS_EXTRA, what="hybridserve calibrate")
    from hybridserve.executor.torch.calibrate import measure_device
    from hybridserve.sim.calibration_run import run_calibration

    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        TextColumn("{task.completed:.0f} / {task.total:.0f}"),
        TimeElapsedColumn(),
    )
    try:
        with Progress(*columns, console=err, transient=True) as bar:
            task = bar.add_task("loading the model", total=1)

            def progress(what: str, done: int, total: int) -> None:
                label = "measuring peaks" if what == "peaks" else "measuring steps"
                bar.update(task, description=label, completed=done, total=total)

            profile = run_calibration(
                model,
                gpu_name=gpu_name,
                device=device,
                grid=QUICK_GRID if quick else Grid(),
                measure=measure_device,
                seed=seed,
                holdout_fraction=holdout_fraction,
                clock=clock,
                num_threads=threads,
                progress=progress,
            )
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    path = out if out is not None else Path("runs") / "calibration" / f"{gpu_name}.json"
    profile.save(path)
    console = out_console()
    for table in _summary_tables(profile):
        console.print(table)
    console.print(f"calibration: {path}")
