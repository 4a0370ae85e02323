"""benchmarks/step_price_drift.py: every logged run's steps priced by each calibration, placed
at the hour the run ran, and the line of the price against the hour."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from hybridserve.engine.step_log import StepRecord
from tests.benchmark_module import load_benchmark
from tests.unit.test_fidelity_script import twin_inputs

pytest.importorskip("httpx", reason="the benchmark's server helpers need the server extra")

SHAPES = (((1, 300, 0), (1, 500, 0)), ((1, 301, 0), (1, 501, 0), (256, 0, 0)), ((1, 40, 0),))


@pytest.fixture(scope="module")
def drift() -> ModuleType:
    return load_benchmark("step_price_drift")


def _timed(server: str, seed: int, hour: int) -> dict[str, object]:
    return {
        "server": server,
        "time_scale": 8.0,
        "seed": seed,
        "window": "/w.csv",
        "began": f"2026-12-07T1{hour}:00:00+00:00",
        "ended": f"2026-12-07T1{hour}:10:00+00:00",
    }


def _log(path: Path, prices: list[float], slower: float) -> None:
    """A step log of SHAPES, each measured at `slower` x its calibrated price."""
    lines = [
        {"t": float(i), "s": p * slower, "exec_s": p * slower, "chunks": [list(c) for c in chunks]}
        for i, (chunks, p) in enumerate(zip(SHAPES, prices, strict=True))
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_each_run_is_priced_where_it_ran_and_the_drift_is_the_line_through_them(
    drift: ModuleType, tmp_path: Path
) -> None:
    from hybridserve.sim.run import simulated_cost_model

    checkpoint, cal = twin_inputs(tmp_path)
    setup = {"model": "smollm2", "duration": 210.0, "warmup": 30.0, "max_model_len": 8_192}
    report = {
        "setup": {**setup, "trace": "t.csv", "time_scales": [8.0]},
        "pool": {"block_size": 32, "num_blocks": 384},
        "runs": [
            _timed(server, seed, hour)
            for server, seed, hour in (("baseline", 0, 2), ("hybridserve", 0, 0), ("vllm", 0, 1))
        ]
        + [{"server": "hybridserve", "time_scale": 8.0, "seed": 1, "failed": {"reason": "x"}}],
    }
    model = simulated_cost_model(drift.twin_config(report, checkpoint, "hybridserve", 8.0, 0, cal))
    shape_of = load_benchmark("step_log_check").shape_of
    prices = [model.step_cost(shape_of(StepRecord(0.0, 0.0, 0.0, c))).total_s for c in SHAPES]
    # The run at 10:05 ran at its calibration's prices, the one at 12:05 a quarter slower.
    _log(tmp_path / "hybridserve-ats8-s0.steps.jsonl", prices, 1.0)
    _log(tmp_path / "baseline-ats8-s0.steps.jsonl", prices, 1.25)
    rows = drift.price_runs(report, [cal], tmp_path, checkpoint)
    # vLLM writes no step log, a failed run has none: neither is priced.
    assert [(r["server"], r["time_from"]) for r in rows] == [
        ("baseline", "run"),
        ("hybridserve", "run"),
    ]
    out = drift.summarise(Path("r.json"), rows, [cal])
    first, last = out["runs"]
    assert (first["server"], first["hours"], last["hours"]) == ("hybridserve", 0.0, 2.0)
    assert first["ratio_of_sums"][str(cal)]["all"] == pytest.approx(1.0, abs=1e-4)
    assert last["ratio_of_sums"][str(cal)]["all"] == pytest.approx(0.8, abs=1e-4)
    assert last["ratio_of_sums"][str(cal)]["mixed"] == pytest.approx(0.8, abs=1e-4)
    line = out["drift"][str(cal)]
    assert line["per_hour"] == pytest.approx(-0.1, abs=1e-4)
    assert line["at_first_run"] == pytest.approx(1.0, abs=1e-4)
    assert (line["min"], line["runs"]) == (pytest.approx(0.8, abs=1e-4), 2)


def test_a_run_without_its_step_log_exits_naming_the_folder(
    drift: ModuleType, tmp_path: Path
) -> None:
    report = {
        "setup": {"model": "smollm2", "trace": "t.csv"},
        "runs": [{"server": "baseline", "time_scale": 5.0, "seed": 2}],
    }
    with pytest.raises(
        SystemExit, match=r"--log-dir: .*baseline-ats5-s2\.steps\.jsonl.*cannot read it"
    ):
        drift.price_runs(report, [], tmp_path, tmp_path)
