"""`hybridserve calibrate`: fit the cost model's constants to step times measured on a device."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hybridserve.cli.app import MODELS_EXTRA, app, err, fail, need_extra, out_console
from hybridserve.cli.choices import GPU_NAMES, listed
from hybridserve.core.errors import ConfigError, HybridServeError

if TYPE_CHECKING:
    from hybridserve.sim.calibration import CalibrationProfile, ErrorSummary
    from hybridserve.sim.calibration_fit import Grid


def _check_device(device: str) -> None:
    import torch

    if device != "cpu" and device != "cuda" and not device.startswith("cuda:"):
        raise ConfigError("--device", device, "use cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device", device, "CUDA is not available here; use --device cpu")


def _check_clock(clock: str, device: str, num_threads: int) -> None:
    from hybridserve.sim.calibration import CLOCKS

    if clock not in CLOCKS:
        raise ConfigError("--clock", clock, f"use one of {CLOCKS}")
    if clock == "cpu" and device != "cpu":
        raise ConfigError("--clock", clock, "the cpu clock times CPU work only; use wall on cuda")
    if clock == "cpu" and num_threads != 1:
        raise ConfigError(
            "--clock",
            clock,
            f"it counts one thread's time, torch runs {num_threads}; add --threads 1",
        )


def _check_model_path(path: Path) -> None:
    if not path.exists():
        raise ConfigError("--model", str(path), "the path does not exist; give a checkpoint folder")
    if not (path / "config.json").is_file():
        raise ConfigError(
            "--model",
            str(path),
            "give a checkpoint folder with config.json and *.safetensors (the cost model reads "
            "the model's shape from config.json)",
        )


def run_calibration(
    model_path: Path,
    *,
    gpu_name: str,
    device: str,
    grid: Grid,
    seed: int = 0,
    holdout_fraction: float = 0.25,
    clock: str = "wall",
    num_threads: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> CalibrationProfile:
    """Measure the torch executor over `grid` on `device`, fit, and return the profile.
    `num_threads` sets torch's intra-op threads (None: leave them). `progress(what, done,
    total)` reports the measurement. Raises ConfigError."""
    import time

    import torch

    from hybridserve.executor.torch.calibrate import (
        TORCH_DTYPES,
        StepTimer,
        executor_for,
        measure_peaks,
        measure_steps,
    )
    from hybridserve.executor.torch.loader import load_model
    from hybridserve.sim.calibration import CalibrationProfile
    from hybridserve.sim.calibration_fit import (
        fit_measurements,
        measured_gpu_spec,
        request_tokens,
    )
    from hybridserve.sim.fit import CostSetup
    from hybridserve.sim.gpus import GPUS, get_gpu
    from hybridserve.sim.hf_config import load_model_profile

    _check_device(device)
    if num_threads is not None:
        if num_threads < 1:
            raise ConfigError("--threads", num_threads, "use 1 or more")
        torch.set_num_threads(num_threads)
    _check_clock(clock, device, torch.get_num_threads())
    timer_clock = time.thread_time if clock == "cpu" else time.perf_counter
    path = model_path.expanduser()
    _check_model_path(path)
    if not 0 <= holdout_fraction < 1:
        raise ConfigError("--holdout-fraction", holdout_fraction, "use a fraction in [0, 1)")
    in_catalog = gpu_name in GPUS
    if in_catalog and device == "cpu":
        raise ConfigError(
            "--gpu-name", gpu_name, "that is a catalog GPU; name the CPU something else, e.g. cpu"
        )
    profile_model = load_model_profile(path)
    dtype = "fp32" if device == "cpu" else "bf16"  # what the executor serves in on each
    model = load_model(path, dtype=TORCH_DTYPES[dtype])
    if in_catalog:
        gpu = get_gpu(gpu_name)
    else:
        if progress is not None:
            progress("peaks", 0, 1)
        peaks = measure_peaks(device, clock=timer_clock)
        gpu = measured_gpu_spec(
            gpu_name,
            fp32_flops=peaks.fp32_flops,
            bf16_flops=peaks.bf16_flops,
            copy_bytes_per_s=peaks.copy_bytes_per_s,
            memory_bytes=peaks.memory_bytes,
        )
    executor = executor_for(
        model,
        max_tokens=grid.max_tokens_per_step,
        max_requests=max(grid.decode_batches),
        device=device,
    )
    timer = StepTimer(executor, vocab_size=profile_model.vocab_size, seed=seed, clock=timer_clock)
    shapes = grid.shapes()
    seconds = measure_steps(
        timer,
        [request_tokens(s) for s in shapes],
        rounds=grid.rounds,
        repeats=grid.repeats,
        progress=None if progress is None else lambda d, t: progress("steps", d, t),
    )
    setup = CostSetup(gpu=gpu, model=profile_model, dtype=dtype, kv_dtype=dtype)
    fit = fit_measurements(
        list(zip(shapes, seconds, strict=True)),
        setup=setup,
        holdout_fraction=holdout_fraction,
        seed=seed,
    )
    return CalibrationProfile(
        device=gpu_name,
        gpu=gpu,
        peaks="datasheet" if in_catalog else "measured",
        efficiency=fit.efficiency,
        model=profile_model.name,
        dtype=dtype,
        kv_dtype=dtype,
        torch_version=str(torch.__version__),
        torch_device=device,
        num_threads=torch.get_num_threads(),
        clock=clock,
        seed=seed,
        holdout_fraction=holdout_fraction,
        samples=fit.rows,
        in_sample=fit.in_sample,
        held_out=fit.held_out,
    )


def _summary_tables(profile: CalibrationProfile) -> tuple[Table, Table]:
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
    model: Annotated[Path, typer.Option(help="Checkpoint folder (config.json + safetensors).")],
    gpu_name: Annotated[
        str,
        typer.Option(
            help=f"The device's name: a catalog GPU ({listed(GPU_NAMES)}) keeps its datasheet "
            "peaks; any other name (e.g. cpu) gets measured peaks."
        ),
    ],
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    out: Annotated[
        Path | None, typer.Option(help="Profile file [default: runs/calibration/NAME.json].")
    ] = None,
    quick: Annotated[bool, typer.Option(help="A small grid (about 10 s on a CPU).")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the token ids and the held-out split.")] = 0,
    holdout_fraction: Annotated[
        float, typer.Option(help="Share of the step shapes held out of the fit, in [0, 1).")
    ] = 0.25,
    threads: Annotated[
        int | None, typer.Option(help="torch intra-op threads [default: torch's choice].")
    ] = None,
    clock: Annotated[
        str,
        typer.Option(
            help="wall (perf_counter), or cpu: the thread's CPU time, for a shared machine "
            "(--device cpu --threads 1)."
        ),
    ] = "wall",
) -> None:
    """Measure step times on a device, fit the cost model's constants, write a profile for
    `hybridserve simulate --calibration FILE`."""
    from hybridserve.sim.calibration_fit import QUICK_GRID, Grid

    need_extra("models", *MODELS_EXTRA, what="hybridserve calibrate")
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
    console.print(f"profile: {path}")
