"""Calibration files without torch: the held-out fit, the JSON file and its errors."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hybridserve.cli import app
from hybridserve.core.errors import ConfigError
from hybridserve.sim.calibration import Calibration, describe
from hybridserve.sim.calibration_fit import (
    CALIBRATION_PARAMS,
    Grid,
    fit_measurements,
    fitted_params,
    holdout_split,
    measured_gpu,
)
from hybridserve.sim.cost_model import Efficiency, StepShape
from hybridserve.sim.fit import DEFAULT_PARAMS, CostSetup
from hybridserve.sim.gpus import get_gpu
from hybridserve.sim.hf_config import profile_from_hf_config

CPU = measured_gpu(
    "cpu-test", fp32_flops=1.5e11, bf16_flops=1e12, copy_bytes_per_s=1.2e10, memory_bytes=2.4e10
)
# A small Llama (about 5M parameters), the size the CPU calibration test measures.
MODEL_CONFIG = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 1024,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "vocab_size": 4096, "tie_word_embeddings": False,
}  # fmt: skip
SETUP = CostSetup(
    gpu=CPU, model=profile_from_hf_config(MODEL_CONFIG), dtype="fp32", kv_dtype="fp32"
)
TRUE = Efficiency(gemm=0.6, attention=0.4, hbm=0.7, step_overhead_s=3e-3, shared_kv=0.6)
GRID = Grid(decode_batches=(1, 4, 16, 32), decode_shared_fraction=0.5)


def _measurements(efficiency: Efficiency = TRUE) -> list[tuple[StepShape, float]]:
    model = SETUP.cost_model(efficiency)
    return [(shape, model.step_cost(shape).total_s) for shape in GRID.shapes()]


@functools.cache
def _fitted() -> Calibration:
    fit = fit_measurements(_measurements(), setup=SETUP, holdout_fraction=0.25, seed=0)
    return Calibration(
        device=CPU.name, gpu=CPU, peaks="measured", efficiency=fit.efficiency,
        model="small-llama", dtype="fp32", kv_dtype="fp32", torch_version="2.13.0",
        torch_device="cpu", num_threads=1, clock="cpu", seed=0, holdout_fraction=0.25,
        samples=fit.rows, in_sample=fit.in_sample, held_out=fit.held_out,
    )  # fmt: skip


def _calibration(**changes: Any) -> Calibration:
    return replace(_fitted(), **changes)


def test_fit_on_exact_times_predicts_the_held_out_shapes() -> None:
    fit = fit_measurements(_measurements(), setup=SETUP, holdout_fraction=0.25, seed=0)
    assert fit.held_out is not None and fit.held_out.num_samples == 7
    assert fit.held_out.max < 0.02 and fit.in_sample.max < 0.02
    assert fit.efficiency.gemm == pytest.approx(TRUE.gemm, rel=0.05)


def test_fit_recovers_the_shared_prefix_read_from_decodes_that_share_one() -> None:
    """The grid's decode batches whose contexts begin in the same blocks fit `shared_kv` (the
    rest fit without them); a grid that measures none leaves it 0, and then prices those
    batches at their unshared time."""
    shared = [s for s in GRID.shapes() if s.shared_kv_tokens]
    assert len(shared) == 9 and {s.shared_prefix_tokens for s in shared} == {64, 512, 1024}
    fit = fit_measurements(_measurements(), setup=SETUP, holdout_fraction=0.25, seed=0)
    assert fit.efficiency.shared_kv == pytest.approx(TRUE.shared_kv, abs=0.02)
    unshared = replace(GRID, decode_shared_fraction=0.0)
    model = SETUP.cost_model(TRUE)
    timed = [(shape, model.step_cost(shape).total_s) for shape in unshared.shapes()]
    blind = fit_measurements(timed, setup=SETUP, holdout_fraction=0.25, seed=0)
    assert blind.efficiency.shared_kv == 0.0
    big = max(shared, key=lambda s: s.shared_kv_tokens)
    assert SETUP.cost_model(blind.efficiency).step_cost(big).total_s > 1.1 * (
        model.step_cost(big).total_s
    )


def test_fit_separates_the_kv_read_rate_where_the_decodes_identify_it() -> None:
    """An executor that reads its KV at a third of its weights' rate (a gather before the
    attention): the default grid (three batches at three contexts) recovers the KV rate and
    predicts the held-out shapes; a grid of two contexts keeps one rate (`calibrate --url`'s),
    and the fit is then worse. (This 5M-parameter model's weights are read in well under the
    step overhead, so `hbm` itself is not pinned by these shapes.)"""
    truth = replace(TRUE, kv_hbm=0.25)
    fit = fit_measurements(_measurements(truth), setup=SETUP, holdout_fraction=0.25, seed=0)
    assert fit.efficiency.kv_hbm == pytest.approx(0.25, rel=0.05)
    assert fit.held_out is not None and fit.held_out.median < 0.01 and fit.held_out.max < 0.05
    assert fitted_params(GRID.shapes()) == CALIBRATION_PARAMS
    two_contexts = Grid(decode_batches=(1, 8, 32), decode_context_tokens=(256, 4096))
    assert fitted_params(two_contexts.shapes()) == DEFAULT_PARAMS
    model = SETUP.cost_model(truth)
    timed = [(shape, model.step_cost(shape).total_s) for shape in two_contexts.shapes()]
    one_rate = fit_measurements(timed, setup=SETUP, holdout_fraction=0.0, seed=0)
    assert one_rate.efficiency.kv_hbm is None and one_rate.in_sample.max > 0.05


def test_calibration_files_from_before_the_kv_rate_host_link_and_sharing_still_load(
    tmp_path: Path,
) -> None:
    def strip(data: dict[str, Any]) -> None:
        data["efficiency"].pop("kv_hbm")
        data["efficiency"].pop("shared_kv")
        for sample in data["samples"]:
            sample.pop("shared_kv_tokens")
        for name in (
            "host_link_bytes_per_s",
            "host_link_latency_s",
            "fp32_stream_bytes_per_s",
            "bf16_stream_bytes_per_s",
        ):
            data["gpu"].pop(name)

    loaded = Calibration.load(_write(tmp_path, strip))
    assert loaded.gpu.stream_bytes_per_s("fp32") is None
    assert loaded.efficiency.kv_hbm is None and loaded.efficiency.shared_kv == 0.0
    assert all(sample.shared_kv_tokens == 0 for sample in loaded.samples)
    assert loaded.efficiency.kv_bandwidth == loaded.efficiency.hbm
    assert loaded.gpu.host_link_bytes_per_s == CPU.host_link_bytes_per_s


def test_a_shared_fraction_outside_zero_to_one_is_refused_naming_the_flag(tmp_path: Path) -> None:
    assert Grid().shapes() == replace(Grid(), decode_shared_fraction=0.0).shapes()  # off
    for args in (["--model", str(tmp_path), "--gpu-name", "cpu"], ["--url", "http://x:1"]):
        result = CliRunner().invoke(app, ["calibrate", *args, "--decode-shared-fraction", "1.5"])
        assert result.exit_code == 2, result.output
        assert "--decode-shared-fraction" in result.output and "Traceback" not in result.output


def test_holdout_split_is_seeded_and_keeps_each_kind_in_the_fit() -> None:
    shapes = GRID.shapes()
    held = holdout_split(shapes, fraction=0.25, seed=3)
    assert held == holdout_split(shapes, fraction=0.25, seed=3)
    assert held != holdout_split(shapes, fraction=0.25, seed=4)
    kinds = {
        "shared" if shapes[i].shared_kv_tokens else all(r.is_decode for r in shapes[i].requests)
        for i in held
    }
    assert kinds == {True, False, "shared"}
    # With one shape of each kind, both stay in the fit.
    assert holdout_split([shapes[0], shapes[-1]], fraction=0.9, seed=0) == set()
    with pytest.raises(ConfigError, match="holdout_fraction"):
        holdout_split(shapes, fraction=1.0, seed=0)


def test_describe_names_prefills_and_decodes() -> None:
    assert describe(StepShape.prefill(512, context_tokens=1024)) == "prefill 512 after 1024"
    assert describe(StepShape.decode(batch=16, context_tokens=2048)) == "decode 16 x 2048"
    shared = StepShape.decode(batch=16, context_tokens=2048, shared_tokens=1024)
    assert describe(shared) == "decode 16 x 2048 sharing 1024"


def test_calibration_round_trips_through_json(tmp_path: Path) -> None:
    streamed = replace(CPU, fp32_stream_bytes_per_s=8.4e9, bf16_stream_bytes_per_s=None)
    calibration = _calibration(gpu=streamed)
    path = tmp_path / "sub" / "cpu.json"
    calibration.save(path)
    loaded = Calibration.load(path)
    assert loaded == calibration
    assert loaded.gpu.stream_bytes_per_s("fp32") == 8.4e9
    for row in loaded.samples:  # the rows rebuild the measured shapes
        predicted = SETUP.cost_model(loaded.efficiency).step_cost(row.shape()).total_s
        assert predicted == pytest.approx(row.predicted_s, rel=1e-12)


def _write(tmp_path: Path, mutate: Any) -> Path:
    data = _calibration().to_json()
    mutate(data)
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("efficiency"), r"calibration\.efficiency"),
        (lambda d: d["efficiency"].pop("hbm"), r"calibration\.efficiency\.hbm"),
        (lambda d: d["efficiency"].update(hbm=1.7), r"calibration\.efficiency\.hbm"),
        (lambda d: d["efficiency"].update(gemm="fast"), r"calibration\.efficiency\.gemm"),
        (lambda d: d["gpu"].update(hbm_bytes_per_s=0), r"calibration\.gpu\.hbm_bytes_per_s"),
        (lambda d: d.update(schema_version=9), r"calibration\.schema_version"),
        (lambda d: d.update(clock="sundial"), r"calibration\.clock"),
        (lambda d: d["samples"][0].pop("measured_s"), r"calibration\.samples\[0\]\.measured_s"),
        (lambda d: d["samples"][1].update(requests=[[1, 2]]), r"samples\[1\]\.requests"),
    ],
)  # fmt: skip
def test_bad_calibrations_name_the_field(tmp_path: Path, mutate: Any, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        Calibration.load(_write(tmp_path, mutate))


def test_missing_and_malformed_files_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="hybridserve calibrate"):
        Calibration.load(tmp_path / "absent.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="fix the JSON"):
        Calibration.load(broken)


SIM = ["simulate", "--spec", "none", "--duration", "60", "--warmup", "0", "--workload",
       "fixed:input=256,output=32,concurrency=4,requests=4", "--json"]  # fmt: skip


@pytest.fixture()
def model_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MODEL_CONFIG))
    return path


def _tpot_ms(model_config: Path, *extra: str) -> float:
    result = CliRunner().invoke(app, [*SIM, "--model-config", str(model_config), *extra])
    assert result.exit_code == 0, result.output
    return float(json.loads(result.stdout)["tpot_mean_ms"])


def test_simulate_uses_the_calibrations_device_and_constants(
    tmp_path: Path, model_config: Path
) -> None:
    path = tmp_path / "cpu.json"
    calibration = _calibration()
    calibration.save(path)
    calibrated = _tpot_ms(model_config, "--calibration", str(path))
    # Four decodes at 256-288 tokens of context per step, priced by the calibration's constants on
    # its measured device in fp32; the default (H200, fp8, the built-in constants) differs.
    decode = StepShape.decode(batch=4, context_tokens=272)
    expected = SETUP.cost_model(calibration.efficiency).step_cost(decode).total_s * 1e3
    assert calibrated == pytest.approx(expected, rel=0.02)
    h200 = CostSetup(gpu=get_gpu("H200"), model=SETUP.model, dtype="fp8", kv_dtype="bf16")
    assert abs(h200.cost_model(Efficiency()).step_cost(decode).total_s * 1e3 - expected) > (
        0.2 * expected
    )  # what the run would show without the calibration
    slower = _calibration(efficiency=replace(TRUE, step_overhead_s=TRUE.step_overhead_s + 0.05))
    slower.save(path)
    # 50 ms more per step, paid by every decode step: the TPOT moves by exactly that.
    moved = _tpot_ms(model_config, "--calibration", str(path)) - calibrated
    assert moved == pytest.approx(50.0, abs=0.5)


def test_simulate_rejects_a_conflicting_gpu_and_a_missing_calibration(
    tmp_path: Path, model_config: Path
) -> None:
    path = tmp_path / "cpu.json"
    _calibration().save(path)
    sim = [*SIM, "--model-config", str(model_config)]
    result = CliRunner().invoke(app, [*sim, "--calibration", str(path), "--gpu", "H200"])
    assert result.exit_code == 2 and "drop --gpu" in result.output
    same = CliRunner().invoke(app, [*sim, "--calibration", str(path), "--gpu", "cpu-test"])
    assert same.exit_code == 0, same.output
    absent = CliRunner().invoke(app, [*sim, "--calibration", str(tmp_path / "nope.json")])
    assert absent.exit_code == 2 and "no such file" in absent.output
    tp2 = CliRunner().invoke(app, [*sim, "--calibration", str(path), "--tp", "2"])
    assert tp2.exit_code == 2 and "no measured interconnect" in tp2.output


def test_calibration_module_leaves_torch_out() -> None:
    code = "import sys, hybridserve.sim.calibration_fit; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
