"""The cost-model scorecard script (benchmarks/cost_model_scorecard.py) on its fast rows."""

from __future__ import annotations

import json
from types import ModuleType

import pytest

from hybridserve.sim.cost_model import Efficiency
from tests.benchmark_module import load_benchmark


def _scorecard_module() -> ModuleType:
    return load_benchmark("cost_model_scorecard")


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


def test_every_hybrid_row_is_run_and_none_enters_the_fit(scorecard: ModuleType) -> None:
    published = {row["id"] for row in json.loads(scorecard.HYBRID_MEASUREMENTS.read_text())}
    assert {row.id for row in scorecard.HYBRID_ROWS} == published
    assert all(not use for row in scorecard.HYBRID_ROWS for *_, use in row.metrics)
    assert {r.regime for r in scorecard.HYBRID_ROWS} == {scorecard.HYBRID}


def test_qwen3_coder_next_decode_rows_are_within_15_percent(scorecard: ModuleType) -> None:
    # H1 and H3 fix the two hybrid constants (expert-kernel bandwidth, per-GDN-layer time);
    # H2, decode at 256K context, checks them: the attention KV read and the GDN state terms.
    rows = tuple(r for r in scorecard.HYBRID_ROWS if r.id in ("H1", "H2", "H3"))
    report, samples = scorecard.scorecard(rows, Efficiency(), log=False)
    assert samples == []  # the hybrid rows check the fit, they are not part of it
    errors = {r["id"]: r["relative_error"] for r in report["rows"]}
    assert set(errors) == {"H1", "H2", "H3"}
    assert all(abs(e) < 0.15 for e in errors.values()), errors
    # Without the hybrid constants (the dense-model fit alone) batched decode is far too fast.
    dense_only = Efficiency(moe_hbm=Efficiency().hbm, recurrent_layer_s=0.0)
    report, _ = scorecard.scorecard(rows, dense_only, log=False)
    assert {r["id"]: r["relative_error"] for r in report["rows"]}["H3"] > 0.3
