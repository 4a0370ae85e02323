"""The cost-model scorecard script (benchmarks/cost_model_scorecard.py) on its fast rows."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hybridserve.sim.cost_model import Efficiency

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _scorecard_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "cost_model_scorecard", BENCHMARKS / "cost_model_scorecard.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scorecard() -> ModuleType:
    module = _scorecard_module()
    if not module.MEASUREMENTS.exists():
        pytest.skip(f"{module.MEASUREMENTS} is not present")
    return module


def test_every_published_row_is_either_run_or_listed_with_a_reason(scorecard: ModuleType) -> None:
    published = {row["id"] for row in json.loads(scorecard.MEASUREMENTS.read_text())}
    run = {row.id for row in scorecard.ROWS}
    listed = set(scorecard.NOT_EXPRESSIBLE)
    assert run.isdisjoint(listed)
    assert run | listed == published


def test_batch_one_rows_report_error_and_fit_samples(scorecard: ModuleType) -> None:
    rows = tuple(r for r in scorecard.ROWS if r.regime == scorecard.BATCH1)
    report, samples = scorecard.scorecard(rows, Efficiency(), log=False)
    assert len(report["rows"]) == 3 and len(samples) == 3
    for row in report["rows"]:
        error = row["simulated"] / row["measured"] - 1
        assert row["relative_error"] == pytest.approx(error, abs=1e-4)
        assert abs(row["relative_error"]) < 0.5
    # a TTFT sample predicts the simulated TTFT: one request's prefill step
    for sample, row in zip(samples, report["rows"], strict=True):
        assert sample.predicted_s(Efficiency()) * 1000 == pytest.approx(row["simulated"], rel=1e-3)
    assert set(report["per_regime"]) == {scorecard.BATCH1}
