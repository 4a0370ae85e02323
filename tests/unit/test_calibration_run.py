"""The calibration workflow without torch: a device given as a function of exact step times."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from hybridserve.core.errors import ConfigError
from hybridserve.sim.calibration_fit import Grid, fit_measurements, measured_gpu, pinned_hbm
from hybridserve.sim.calibration_run import run_calibration
from hybridserve.sim.cost_model import Efficiency, RequestShape, StepShape
from hybridserve.sim.fit import CostSetup
from hybridserve.sim.gpus import get_gpu
from hybridserve.sim.hf_config import profile_from_hf_config

MODEL_CONFIG = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 1024,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "vocab_size": 4096, "tie_word_embeddings": False,
}  # fmt: skip
TRUE = Efficiency(gemm=0.6, attention=0.4, hbm=0.7, step_overhead_s=3e-3)


@dataclass(frozen=True)
class Peaks:
    fp32_flops: float = 1.5e11
    bf16_flops: float = 1e12
    copy_bytes_per_s: float = 1.2e10
    memory_bytes: float = 2.4e10
    fp32_stream_bytes_per_s: float | None = None
    bf16_stream_bytes_per_s: float | None = None


@dataclass(frozen=True)
class Measured:
    seconds: tuple[float, ...]
    peaks: Peaks | None
    torch_version: str = "test"
    num_threads: int = 3


class ExactDevice:
    """Step times of the cost model at TRUE on `gpu`; records what it was asked."""

    def __init__(self, gpu_name: str | None, peaks: Peaks | None = None) -> None:
        self.gpu_name = gpu_name
        self.peaks = Peaks() if peaks is None else peaks
        self.asked: dict[str, Any] = {}

    def __call__(
        self, model_path: Path, *, requests: Sequence[Sequence[tuple[int, int, int]]], **asked: Any
    ) -> Measured:
        self.asked = {"model_path": model_path, "requests": requests, **asked}
        peaks = self.peaks if asked["with_peaks"] else None
        gpu = get_gpu(self.gpu_name) if self.gpu_name else measured_gpu("device", **vars(Peaks()))
        setup = CostSetup(
            gpu=gpu,
            model=profile_from_hf_config(MODEL_CONFIG),
            dtype=asked["dtype"],
            kv_dtype=asked["dtype"],
        )
        model = setup.cost_model(TRUE)
        shapes = [
            StepShape(
                tuple(RequestShape(n, c) for n, c, _ in shape),
                shared_kv_tokens=shape[0][2] * (len(shape) - 1),
            )
            for shape in requests
        ]
        return Measured(tuple(model.step_cost(s).total_s for s in shapes), peaks)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return tmp_path


def test_an_unlisted_device_is_priced_on_its_measured_peaks(checkpoint: Path) -> None:
    device = ExactDevice(None)
    calibration = run_calibration(
        checkpoint, gpu_name="box", device="cpu", grid=Grid(), measure=device, clock="cpu"
    )
    assert device.asked["with_peaks"] and device.asked["dtype"] == "fp32"
    assert device.asked["vocab_size"] == 4096 and device.asked["clock"] == "cpu"
    assert calibration.peaks == "measured" and calibration.gpu.fp32_flops == Peaks().fp32_flops
    assert calibration.held_out is not None and calibration.held_out.median < 0.01
    assert (calibration.torch_version, calibration.num_threads) == ("test", 3)


def test_a_measured_weight_stream_is_recorded_and_pins_hbm_only_when_asked(
    checkpoint: Path,
) -> None:
    # The device's steps are priced at TRUE (hbm 0.7 of the 12 GB/s copy rate); its weight
    # stream read 8.4 GB/s in fp32. `calibrate` records it and fits hbm freely: even on exact
    # step times the fit lands on another split of weight reads and overhead that prices the
    # steps as well (here hbm 0.99 and 3.7 ms against 0.7 and 3 ms).
    streamed = Peaks(fp32_stream_bytes_per_s=0.7 * Peaks().copy_bytes_per_s)
    calibration = run_calibration(
        checkpoint, gpu_name="box", device="cpu", grid=Grid(), measure=ExactDevice(None, streamed)
    )
    assert calibration.gpu.stream_bytes_per_s("fp32") == streamed.fp32_stream_bytes_per_s
    assert calibration.efficiency.hbm != pytest.approx(0.7, rel=0.05)
    assert calibration.in_sample.median < 0.01
    # Pinned, the fit keeps hbm at 0.7 and recovers the overhead around it.
    setup = CostSetup(
        gpu=calibration.gpu,
        model=profile_from_hf_config(MODEL_CONFIG),
        dtype="fp32",
        kv_dtype="fp32",
    )
    timings = [(row.shape(), row.measured_s) for row in calibration.samples]
    pinned = fit_measurements(timings, setup=setup, holdout_fraction=0.25, seed=0, pin_hbm=True)
    assert pinned.efficiency.hbm == pytest.approx(0.7, rel=1e-12)
    assert pinned.efficiency.step_overhead_s == pytest.approx(TRUE.step_overhead_s, rel=0.05)
    # A stream read at half the true rate pins hbm at 0.35: the overhead and the other fractions
    # take up what it misprices. No stream in the dtype served (only bf16's): nothing to pin.
    slow = replace(calibration.gpu, fp32_stream_bytes_per_s=0.35 * Peaks().copy_bytes_per_s)
    half = fit_measurements(
        timings, setup=replace(setup, gpu=slow), holdout_fraction=0.25, seed=0, pin_hbm=True
    )
    assert half.efficiency.hbm == pytest.approx(0.35, rel=1e-12)
    bf16_only = replace(slow, fp32_stream_bytes_per_s=None, bf16_stream_bytes_per_s=1e10)
    assert pinned_hbm(replace(setup, gpu=bf16_only)) is None
    assert pinned_hbm(replace(setup, gpu=bf16_only, dtype="bf16")) == pytest.approx(1e10 / 1.2e10)


def test_a_catalog_gpu_keeps_its_datasheet_and_is_not_asked_for_peaks(checkpoint: Path) -> None:
    device = ExactDevice("H100-SXM")
    calibration = run_calibration(
        checkpoint, gpu_name="H100-SXM", device="cuda", grid=Grid(), measure=device
    )
    assert not device.asked["with_peaks"] and device.asked["dtype"] == "bf16"
    assert calibration.peaks == "datasheet" and calibration.gpu == get_gpu("H100-SXM")
    assert calibration.held_out is not None and calibration.held_out.median < 0.01


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"device": "tpu"}, "--device"),
        ({"clock": "sundial"}, "--clock"),
        ({"clock": "cpu", "device": "cuda"}, "--clock"),
        ({"num_threads": 0}, "--threads"),
        ({"holdout_fraction": 1.0}, "--holdout-fraction"),
        ({"gpu_name": "H200"}, "--gpu-name"),
    ],
)
def test_a_bad_request_is_refused_before_the_device_runs(
    checkpoint: Path, changes: dict[str, Any], field: str
) -> None:
    def never(*args: Any, **kwargs: Any) -> Measured:
        raise AssertionError("the device ran")

    options: dict[str, Any] = {"gpu_name": "box", "device": "cpu", **changes}
    with pytest.raises(ConfigError) as caught:
        run_calibration(checkpoint, grid=Grid(), measure=never, **options)
    assert caught.value.field == field


def test_a_folder_without_config_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config\.json"):
        run_calibration(
            tmp_path, gpu_name="box", device="cpu", grid=Grid(), measure=ExactDevice(None)
        )


def test_the_workflow_module_leaves_torch_out() -> None:
    code = "import sys, hybridserve.sim.calibration_run; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
