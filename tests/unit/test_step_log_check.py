"""The pure parts of benchmarks/step_log_check.py: each logged step priced on its own shape,
the schedule's figures per kind of step in the measured window, and the time between steps."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from hybridserve.engine.step_log import StepRecord
from hybridserve.sim.cost_model import RequestShape, RooflineCostModel
from hybridserve.sim.gpus import get_gpu
from hybridserve.sim.model_profiles import get_model
from tests.benchmark_module import load_benchmark

pytest.importorskip("httpx", reason="the benchmark's server helpers need the server extra")


@pytest.fixture(scope="module")
def check() -> ModuleType:
    return load_benchmark("step_log_check")


def _decode(t: float, s: float, contexts: list[int]) -> StepRecord:
    return StepRecord(t=t, s=s, exec_s=s, chunks=tuple((1, c, 0) for c in contexts))


def test_each_step_is_priced_on_its_own_shape_and_grouped_by_kind_and_batch(
    check: ModuleType,
) -> None:
    model = RooflineCostModel(get_gpu("H200"), get_model("llama-3.1-8b"))
    one = _decode(0.0, 0.0, [1000])
    eight = _decode(1.0, 0.0, [2000] * 8)
    mixed = StepRecord(t=2.0, s=0.0, exec_s=0.0, chunks=((1, 500, 0), (512, 0, 0)))
    price = {id(r): model.step_cost(check.shape_of(r)).total_s for r in (one, eight, mixed)}
    # Measured at twice (one), half (eight) and exactly (mixed) the model's price.
    records = [
        StepRecord(r.t, price[id(r)] * f, price[id(r)] * f, r.chunks)
        for r, f in ((one, 2.0), (eight, 0.5), (mixed, 1.0))
    ]
    rows = check.per_step(records, model)
    assert rows["decode batch 1"]["ratio_p50"] == pytest.approx(0.5)
    assert rows["decode batch 7-9"]["ratio_p50"] == pytest.approx(2.0)
    assert rows["mixed"]["ratio_p50"] == pytest.approx(1.0)
    assert rows["decode"]["steps"] == 2 and rows["all"]["steps"] == 3
    expected = sum(price.values()) / sum(r.s for r in records)
    assert rows["all"]["ratio_of_sums"] == pytest.approx(expected, rel=1e-3)
    assert check.shape_of(mixed).requests == (RequestShape(1, 500), RequestShape(512, 0))


def test_the_schedule_counts_only_the_measured_window_and_the_gaps_between_steps(
    check: ModuleType,
) -> None:
    records = [
        _decode(0.0, 0.1, [10]),  # before the warm-up's end (t0 + 1)
        _decode(1.0, 0.1, [10, 20]),
        _decode(1.15, 0.1, [11, 21, 31]),  # 0.05 s after the step before
        StepRecord(t=1.3, s=1.0, exec_s=1.0, chunks=((1, 12, 0), (300, 0, 0))),
        _decode(5.0, 0.1, [13]),  # at t0 + duration: outside
    ]
    schedule = check.schedule(records, 1.0, 5.0)
    assert schedule["steps"] == 3
    assert schedule["decode"]["steps"] == 2
    assert schedule["decode"]["decode_batch_mean"] == 2.5
    assert schedule["decode"]["decode_context_p50"] == 20  # of 10, 20, 11, 21, 31
    assert schedule["mixed"]["prefill_tokens_mean"] == 300
    assert schedule["mixed"]["decode_tokens"] == 1
    assert schedule["prefill"]["steps"] == 0
    gaps = check.gaps(records)
    # 0.05 and 0.05 are back to back; 0.9 s and 2.7 s are the engine waiting for work.
    assert gaps["back_to_back"] == 2
    assert gaps["gap_s_sum"] == pytest.approx(0.1)


def test_a_trace_reports_twin_is_the_runs_window(check: ModuleType, tmp_path: Path) -> None:
    from tests.unit.test_fidelity_script import LLAMA, _calibration

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(LLAMA))
    cal = _calibration(tmp_path / "cal.json")
    runs = [
        {"server": "hybridserve", "time_scale": ts, "seed": 1, "window": f"/w/ts{ts:g}.csv"}
        for ts in (8.0, 5.0)
    ]
    setup = {"model": "smollm2", "duration": 210.0, "warmup": 30.0, "max_model_len": 8_192}
    report = {
        "setup": {**setup, "trace": "t.csv", "time_scales": [8.0, 5.0]},
        "pool": {"block_size": 32, "num_blocks": 384},
        "runs": runs,
    }
    config = check.twin_config(report, checkpoint, "hybridserve", 5.0, 1, cal)
    assert (config.workload, config.time_scale, config.preset) == (
        "azure:/w/ts5.csv",
        5.0,
        "hybridserve",
    )
    with pytest.raises(SystemExit, match="no baseline run at time scale 5, seed 1"):
        check.twin_config(report, checkpoint, "baseline", 5.0, 1, cal)
