"""`hybridserve calibrate --quick` writes a calibration that `hybridserve simulate` then uses."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hybridserve.cli import app
from hybridserve.sim.calibration import Calibration
from hybridserve.sim.cost_model import StepShape
from hybridserve.sim.fit import CostSetup
from hybridserve.sim.hf_config import load_model_profile

SIM = ["simulate", "--spec", "none", "--duration", "60", "--warmup", "0", "--workload",
       "fixed:input=128,output=16,concurrency=2,requests=4", "--json"]  # fmt: skip


@pytest.fixture(scope="module")
def quick_profile(
    calib_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("calibration") / "cpu.json"
    result = CliRunner().invoke(
        app,
        ["calibrate", "--model", str(calib_checkpoint), "--gpu-name", "cpu-ci", "--quick",
         "--threads", "1", "--clock", "cpu", "--out", str(out)],
    )  # fmt: skip
    return out, result.output


def test_quick_calibration_writes_a_profile_and_prints_the_fit(
    quick_profile: tuple[Path, str],
) -> None:
    path, output = quick_profile
    assert path.is_file(), output
    calibration = Calibration.load(path)
    assert calibration.device == "cpu-ci" and calibration.peaks == "measured"
    assert len(calibration.samples) == 12 and calibration.held_out is not None
    assert calibration.efficiency.shared_kv == 0.0  # not measured unless asked
    assert "held-out |error|" in output and "step_overhead" in output and "shared_kv" in output
    # The weight stream is read in the dtype served (fp32 on a CPU), recorded and shown.
    stream = calibration.gpu.stream_bytes_per_s("fp32")
    assert stream is not None and stream > 0 and "weight stream" in output


def test_simulate_prices_steps_with_the_calibration(
    quick_profile: tuple[Path, str], calib_checkpoint: Path
) -> None:
    path, _ = quick_profile
    calibration = Calibration.load(path)
    sim = [*SIM, "--model-config", str(calib_checkpoint)]
    result = CliRunner().invoke(app, [*sim, "--calibration", str(path)])
    assert result.exit_code == 0, result.output
    tpot_ms = json.loads(result.stdout)["tpot_mean_ms"]
    # Two decodes at 128-144 tokens of context, on the measured device with the fitted constants.
    setup = CostSetup(
        gpu=calibration.gpu,
        model=load_model_profile(calib_checkpoint),
        dtype="fp32",
        kv_dtype="fp32",
    )
    decode = StepShape.decode(batch=2, context_tokens=136)
    expected_ms = setup.cost_model(calibration.efficiency).step_cost(decode).total_s * 1e3
    assert tpot_ms == pytest.approx(expected_ms, rel=0.02)
    # The run follows the file: the same calibration with 5 ms more per step prices the step 5
    # ms higher. (A comparison with the default H200's price cannot tell them apart reliably:
    # the measured CPU constants vary from run to run, and once priced this step within 1% of
    # the H200.)
    shifted = json.loads(path.read_text())
    shifted["efficiency"]["step_overhead_s"] += 0.005
    shifted_path = path.with_name("cpu_shifted.json")
    shifted_path.write_text(json.dumps(shifted))
    moved = CliRunner().invoke(app, [*sim, "--calibration", str(shifted_path)])
    assert moved.exit_code == 0, moved.output
    shifted_efficiency = replace(
        calibration.efficiency, step_overhead_s=calibration.efficiency.step_overhead_s + 0.005
    )
    shifted_ms = setup.cost_model(shifted_efficiency).step_cost(decode).total_s * 1e3
    assert shifted_ms == pytest.approx(expected_ms + 5.0, rel=0.01)
    assert json.loads(moved.stdout)["tpot_mean_ms"] == pytest.approx(shifted_ms, rel=0.02)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/model"], "does not exist"),
        (["--device", "tpu"], "use cpu, cuda"),
        (["--clock", "sundial"], "--clock"),
        (["--gpu-name", "H200"], "catalog GPU"),
        (["--clock", "cpu", "--threads", "2"], "--threads 1"),
        (["--holdout-fraction", "1.5"], "holdout"),
    ],
)
def test_calibrate_errors_name_the_option_and_the_fix(
    calib_checkpoint: Path, args: list[str], message: str
) -> None:
    options = {"--model": str(calib_checkpoint), "--gpu-name": "cpu-ci"}
    options.update(zip(args[::2], args[1::2], strict=True))
    flat = [x for pair in options.items() for x in pair]
    threads = torch.get_num_threads()
    try:
        result = CliRunner().invoke(app, ["calibrate", *flat, "--quick"])
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 2, result.output
    assert message in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_calibrate_on_cuda_without_cuda_says_so(calib_checkpoint: Path) -> None:
    args = ["--model", str(calib_checkpoint), "--gpu-name", "H200", "--device", "cuda"]
    result = CliRunner().invoke(app, ["calibrate", *args])
    assert result.exit_code == 2 and "CUDA is not available" in result.output
