"""`hybridserve calibrate`: fit the cost model's constants to step times measured on a device, or
(`--url`) on a running OpenAI-compatible server from the outside."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hybridserve.cli.app import FINITE_FLOAT, MODELS_EXTRA, app, err, fail, need_extra, out_console
from hybridserve.cli.choices import GPU_NAMES, SERVED_MODEL_HELP, listed
from hybridserve.cli.options import (
    ApiKeyOption,
    VocabOption,
)
from hybridserve.core.errors import HybridServeError

if TYPE_CHECKING:
    from hybridserve.sim.calibration import Calibration, ErrorSummary

CalibrateModelOption = Annotated[
    str | None,
    typer.Option(
        help=f"Checkpoint: a folder (config.json + safetensors). With --url: {SERVED_MODEL_HELP}"
    ),
]
GpuNameOption = Annotated[
    str | None,
    typer.Option(
        help=f"The device's name: a catalog GPU ({listed(GPU_NAMES)}) keeps its datasheet "
        "peaks; any other name (e.g. cpu) gets measured peaks. With --url: a catalog GPU, "
        "or the device of --peaks-from [default with --url: H200]."
    ),
]
CalibrateUrlOption = Annotated[
    str | None,
    typer.Option(
        help="Calibrate a running OpenAI-compatible server (vLLM, hybridserve serve) from the "
        "outside, over HTTP: its base URL, e.g. http://127.0.0.1:8000."
    ),
]
UrlModelConfigOption = Annotated[
    Path | None,
    typer.Option(
        help="With --url: the served model's config.json (or its folder), the shape the cost "
        "model prices [default: --model, when it is a catalog profile or a local folder]."
    ),
]
UrlDtypeOption = Annotated[
    str | None,
    typer.Option(help="With --url: the weights' dtype (bf16, fp8, fp32) [default: bf16]."),
]
PeaksFromOption = Annotated[
    Path | None,
    typer.Option(
        help="With --url: take the device's peaks from this calibration file (one measured "
        "on that device by `hybridserve calibrate --model ...`), for a device off the catalog."
    ),
]
ServerSpeedOption = Annotated[
    float,
    typer.Option(
        parser=FINITE_FLOAT,
        help="With --url: the server runs this many times faster than the device it models "
        "(serve --executor sim --sim-speed); 1 for a real server.",
    ),
]
ContextOption = Annotated[
    int | None,
    typer.Option(
        help="With --url: the long cached context of the grid (prefills after it, decodes at "
        "it) [default: 4096, --quick 8192]; the server's --max-model-len must hold it + 1100."
    ),
]
SharedFractionOption = Annotated[
    float,
    typer.Option(
        parser=FINITE_FLOAT,
        help="Measure the decode batches again with this share of their context in the same "
        "blocks (a shared system prompt) and fit the cost model's shared_kv on them, in [0, 1); "
        "0 (the default) measures none and keeps shared_kv 0.",
    ),
]
CalibrateDeviceOption = Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")]
CalibrationOutOption = Annotated[
    Path | None, typer.Option(help="Calibration file [default: runs/calibration/NAME.json].")
]
QuickOption = Annotated[bool, typer.Option(help="A small grid (about 10 s on a CPU).")]
CalibrateSeedOption = Annotated[
    int, typer.Option(help="Seed of the token ids and the held-out split.")
]
HoldoutOption = Annotated[
    float,
    typer.Option(
        parser=FINITE_FLOAT, help="Share of the step shapes held out of the fit, in [0, 1)."
    ),
]
CalibrateThreadsOption = Annotated[
    int | None, typer.Option(help="torch intra-op threads [default: torch's choice].")
]
ClockOption = Annotated[
    str,
    typer.Option(
        help="wall (perf_counter), or cpu: the thread's CPU time, for a shared machine "
        "(--device cpu --threads 1)."
    ),
]


def _stream(calibration: Calibration) -> str:
    rate = calibration.gpu.stream_bytes_per_s(calibration.dtype)
    return "-" if rate is None else f"{rate / 1e9:.1f} GB/s ({calibration.dtype})"


def _summary_tables(calibration: Calibration) -> tuple[Table, Table]:
    eff, gpu = calibration.efficiency, calibration.gpu
    fp32 = "-" if gpu.fp32_flops is None else f"{gpu.fp32_flops / 1e12:.3f} TFLOP/s"
    summary = Table(
        title=f"calibration: {calibration.model} ({calibration.dtype}) on {calibration.device}"
    )
    summary.add_column("item")
    summary.add_column("value", justify="right")
    rows = [
        (f"peaks ({calibration.peaks})", f"bf16 {gpu.bf16_flops / 1e12:.3f} TFLOP/s, fp32 {fp32}"),
        ("memory bandwidth", f"{gpu.hbm_bytes_per_s / 1e9:.1f} GB/s"),
        ("weight stream", _stream(calibration)),
        ("clock, threads", f"{calibration.clock}, {calibration.num_threads}"),
        ("gemm", f"{eff.gemm:.3f}"),
        ("attention", f"{eff.attention:.3f}"),
        ("hbm", f"{eff.hbm:.3f}"),
        ("kv_hbm (KV reads)", f"{eff.kv_bandwidth:.3f}"),
        ("step_overhead", f"{eff.step_overhead_s * 1e3:.3f} ms"),
        ("shared_kv (shared-prefix reads saved)", f"{eff.shared_kv:.2f}"),
        ("in-sample |error|", _errors(calibration.in_sample)),
        (
            "held-out |error|",
            "-" if calibration.held_out is None else _errors(calibration.held_out),
        ),
    ]
    for row in rows:
        summary.add_row(*row)
    samples = Table(title="measured steps")
    for column in ("step", "measured ms", "predicted ms", "error", "held out"):
        samples.add_column(column, justify="left" if column == "step" else "right")
    for s in calibration.samples:
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


_NO_TARGET = (
    "{} is missing: give --model CHECKPOINT_FOLDER --gpu-name NAME to calibrate this machine's "
    "device, or --url URL to calibrate a running server"
)


@app.command("calibrate")
def calibrate_cmd(
    model: CalibrateModelOption = None,
    gpu_name: GpuNameOption = None,
    device: CalibrateDeviceOption = "cpu",
    out: CalibrationOutOption = None,
    quick: QuickOption = False,
    seed: CalibrateSeedOption = 0,
    holdout_fraction: HoldoutOption = 0.25,
    threads: CalibrateThreadsOption = None,
    clock: ClockOption = "wall",
    url: CalibrateUrlOption = None,
    api_key: ApiKeyOption = None,
    model_config: UrlModelConfigOption = None,
    dtype: UrlDtypeOption = None,
    peaks_from: PeaksFromOption = None,
    server_speed: ServerSpeedOption = 1.0,
    vocab_size: VocabOption = 256,
    context_tokens: ContextOption = None,
    decode_shared_fraction: SharedFractionOption = 0.0,
) -> None:
    """Measure step times on a device (or, with --url, on a running server), fit the cost
    model's constants, write a calibration file for `hybridserve simulate --calibration FILE`."""
    if url is not None:
        from hybridserve.cli.calibrate_url import calibrate_url

        calibrate_url(
            url=url,
            model=model,
            api_key=api_key,
            gpu_name=gpu_name or "H200",
            model_config=model_config,
            dtype=dtype,
            peaks_from=peaks_from,
            server_speed=server_speed,
            vocab_size=vocab_size,
            context_tokens=context_tokens,
            out=out,
            quick=quick,
            seed=seed,
            holdout_fraction=holdout_fraction,
            decode_shared_fraction=decode_shared_fraction,
        )
        return
    if model is None or gpu_name is None:
        raise fail(_NO_TARGET.format("--model" if model is None else "--gpu-name"))
    _calibrate_device(
        Path(model),
        gpu_name=gpu_name,
        device=device,
        out=out,
        quick=quick,
        seed=seed,
        holdout_fraction=holdout_fraction,
        threads=threads,
        clock=clock,
        decode_shared_fraction=decode_shared_fraction,
    )


def _calibrate_device(
    model: Path,
    *,
    gpu_name: str,
    device: str,
    out: Path | None,
    quick: bool,
    seed: int,
    holdout_fraction: float,
    threads: int | None,
    clock: str,
    decode_shared_fraction: float = 0.0,
) -> None:
    from hybridserve.sim.calibration_fit import QUICK_GRID, Grid, with_sharing

    need_extra("models", *MODELS_EXTRA, what="hybridserve calibrate")
    from hybridserve.executor.torch.calibrate import measure_device
    from hybridserve.executor.torch.runtime import keep_freed_memory
    from hybridserve.sim.calibration_run import run_calibration

    if device == "cpu":
        keep_freed_memory()  # the steps timed as `serve` runs them on a CPU

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

            calibration = run_calibration(
                model,
                gpu_name=gpu_name,
                device=device,
                grid=with_sharing(QUICK_GRID if quick else Grid(), decode_shared_fraction),
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
    calibration.save(path)
    print_summary(calibration, path)


def print_summary(calibration: Calibration, path: Path) -> None:
    console = out_console()
    for table in _summary_tables(calibration):
        console.print(table)
    console.print(f"calibration: {path}")
