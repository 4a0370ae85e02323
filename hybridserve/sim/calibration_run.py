"""The calibration workflow of `hybridserve calibrate`: check the request, have the device time
the grid's step shapes, fit the cost model's constants, and return the calibration.

The timing runs torch (`hybridserve.executor.torch.calibrate.measure_device`, handed in as
`measure`); this module sees only its result and never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from hybridserve.core.errors import ConfigError
from hybridserve.sim.calibration import CLOCKS, Calibration
from hybridserve.sim.calibration_fit import (
    Grid,
    fit_measurements,
    measured_gpu,
    request_tokens,
)
from hybridserve.sim.cost_model import StepShape
from hybridserve.sim.fit import CostSetup
from hybridserve.sim.gpus import GPUS, Gpu, get_gpu
from hybridserve.sim.hf_config import load_model_profile
from hybridserve.sim.model_profiles import ModelProfile

Progress = Callable[[str, int, int], None]  # (what: "peaks" or "steps", done, total)


class MeasuredPeaks(Protocol):
    @property
    def fp32_flops(self) -> float: ...

    @property
    def bf16_flops(self) -> float: ...

    @property
    def copy_bytes_per_s(self) -> float: ...

    @property
    def memory_bytes(self) -> float: ...

    @property
    def fp32_stream_bytes_per_s(self) -> float | None: ...

    @property
    def bf16_stream_bytes_per_s(self) -> float | None: ...


class Measurement(Protocol):
    """Seconds per step shape (in the order asked), the device's peaks (when asked) and the
    torch the steps ran under."""

    @property
    def seconds(self) -> Sequence[float]: ...

    @property
    def peaks(self) -> MeasuredPeaks | None: ...

    @property
    def torch_version(self) -> str: ...

    @property
    def num_threads(self) -> int: ...


class Measure(Protocol):
    """Times `requests` (one (num_new_tokens, num_context_tokens) pair per request of each
    step shape) on a device: `measure_device` in `hybridserve.executor.torch.calibrate`."""

    def __call__(
        self,
        model_path: Path,
        *,
        device: str,
        dtype: str,
        clock: str,
        num_threads: int | None,
        requests: Sequence[Sequence[tuple[int, int, int]]],
        rounds: int,
        repeats: int,
        vocab_size: int,
        seed: int,
        max_tokens: int,
        max_requests: int,
        with_peaks: bool,
        progress: Progress | None = None,
    ) -> Measurement: ...


def check_request(
    model_path: Path,
    *,
    gpu_name: str,
    device: str,
    holdout_fraction: float,
    clock: str,
    num_threads: int | None,
) -> None:
    """Refuse, before anything loads, what calibration cannot run. Raises ConfigError."""
    if device != "cpu" and device != "cuda" and not device.startswith("cuda:"):
        raise ConfigError("--device", device, "use cpu, cuda or cuda:N")
    if num_threads is not None and num_threads < 1:
        raise ConfigError("--threads", num_threads, "use 1 or more")
    if clock not in CLOCKS:
        raise ConfigError("--clock", clock, f"use one of {CLOCKS}")
    if clock == "cpu" and device != "cpu":
        raise ConfigError("--clock", clock, "the cpu clock times CPU work only; use wall on cuda")
    if not model_path.exists():
        raise ConfigError(
            "--model", str(model_path), "the path does not exist; give a checkpoint folder"
        )
    if not (model_path / "config.json").is_file():
        raise ConfigError(
            "--model",
            str(model_path),
            "give a checkpoint folder with config.json and *.safetensors (the cost model reads "
            "the model's shape from config.json)",
        )
    if not 0 <= holdout_fraction < 1:
        raise ConfigError("--holdout-fraction", holdout_fraction, "use a fraction in [0, 1)")
    if gpu_name in GPUS and device == "cpu":
        raise ConfigError(
            "--gpu-name", gpu_name, "that is a catalog GPU; name the CPU something else, e.g. cpu"
        )


def run_calibration(
    model_path: Path,
    *,
    gpu_name: str,
    device: str,
    grid: Grid,
    measure: Measure,
    seed: int = 0,
    holdout_fraction: float = 0.25,
    clock: str = "wall",
    num_threads: int | None = None,
    progress: Progress | None = None,
) -> Calibration:
    """Time `grid` on `device` with `measure`, fit, and return the calibration. A catalog GPU
    keeps its datasheet peaks; any other name gets the measured ones. `num_threads` sets
    torch's intra-op threads (None: leave them). Raises ConfigError."""
    path = model_path.expanduser()
    check_request(
        path,
        gpu_name=gpu_name,
        device=device,
        holdout_fraction=holdout_fraction,
        clock=clock,
        num_threads=num_threads,
    )
    in_catalog = gpu_name in GPUS
    profile_model = load_model_profile(path)
    dtype = "fp32" if device == "cpu" else "bf16"  # what the executor serves in on each
    shapes = grid.shapes()
    measured = measure(
        path,
        device=device,
        dtype=dtype,
        clock=clock,
        num_threads=num_threads,
        requests=[request_tokens(s) for s in shapes],
        rounds=grid.rounds,
        repeats=grid.repeats,
        vocab_size=profile_model.vocab_size,
        seed=seed,
        max_tokens=grid.max_tokens_per_step,
        max_requests=max(grid.decode_batches),
        with_peaks=not in_catalog,
        progress=progress,
    )
    return _fit_calibration(
        list(zip(shapes, measured.seconds, strict=True)),
        measured,
        model=profile_model,
        gpu_name=gpu_name,
        in_catalog=in_catalog,
        dtype=dtype,
        device=device,
        clock=clock,
        seed=seed,
        holdout_fraction=holdout_fraction,
    )


def _fit_calibration(
    timings: list[tuple[StepShape, float]],
    measured: Measurement,
    *,
    model: ModelProfile,
    gpu_name: str,
    in_catalog: bool,
    dtype: str,
    device: str,
    clock: str,
    seed: int,
    holdout_fraction: float,
) -> Calibration:
    """Fit the cost model to `timings` (seconds per step shape, from `measured`) and return
    the calibration."""
    gpu = _device_gpu(gpu_name, in_catalog=in_catalog, peaks=measured.peaks)
    setup = CostSetup(gpu=gpu, model=model, dtype=dtype, kv_dtype=dtype)
    fit = fit_measurements(timings, setup=setup, holdout_fraction=holdout_fraction, seed=seed)
    return Calibration(
        device=gpu_name,
        gpu=gpu,
        peaks="datasheet" if in_catalog else "measured",
        efficiency=fit.efficiency,
        model=model.name,
        dtype=dtype,
        kv_dtype=dtype,
        torch_version=measured.torch_version,
        torch_device=device,
        num_threads=measured.num_threads,
        clock=clock,
        seed=seed,
        holdout_fraction=holdout_fraction,
        samples=fit.rows,
        in_sample=fit.in_sample,
        held_out=fit.held_out,
    )


def _device_gpu(gpu_name: str, *, in_catalog: bool, peaks: MeasuredPeaks | None) -> Gpu:
    """A catalog GPU's datasheet, else the measured device's peaks."""
    if in_catalog:
        return get_gpu(gpu_name)
    if peaks is None:
        raise RuntimeError(f"{gpu_name} is not in the catalog and its peaks were not measured")
    return measured_gpu(
        gpu_name,
        fp32_flops=peaks.fp32_flops,
        bf16_flops=peaks.bf16_flops,
        copy_bytes_per_s=peaks.copy_bytes_per_s,
        memory_bytes=peaks.memory_bytes,
        fp32_stream_bytes_per_s=peaks.fp32_stream_bytes_per_s,
        bf16_stream_bytes_per_s=peaks.bf16_stream_bytes_per_s,
    )
