"""Request and job metrics: ITL gaps, TTFT, job goodput inside the window."""

from __future__ import annotations

import math

import pytest

from hybridserve.metrics.recorder import MetricsRecorder
from hybridserve.metrics.stats import percentile


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="percentile"):
        percentile([1], 101)


def test_a_multi_token_delivery_is_one_inter_token_gap() -> None:
    rec = MetricsRecorder()
    rec.on_arrival("a", 0.0, prompt_tokens=100)
    rec.on_delivery("a", 0.5, 1)
    rec.on_delivery("a", 0.6, 3)  # three accepted speculative tokens in one step
    rec.on_delivery("a", 0.8, 1)
    rec.on_finish("a", 0.8)
    summary = rec.summary(window_start_s=0.0, window_end_s=10.0)
    assert summary["ttft_p50_ms"] == pytest.approx(500)
    assert rec.requests["a"].gaps_s == pytest.approx([0.1, 0.2])
    assert summary["itl_mean_ms"] == pytest.approx(150)


def test_job_goodput_counts_only_jobs_finishing_inside_the_window() -> None:
    rec = MetricsRecorder()
    for job, finish in (("early", 5.0), ("in1", 700.0), ("in2", 3000.0), ("late", 4000.0)):
        rec.on_job_start(job, 0.0)
        rec.on_job_finish(job, finish)
    rec.on_arrival("r", 0.0, 10)
    rec.on_delivery("r", 1.0, 1)
    rec.on_finish("r", 1000.0)
    summary = rec.summary(window_start_s=600.0, window_end_s=3600.0)
    assert summary["jobs_completed"] == 2
    assert summary["job_goodput_per_hour"] == pytest.approx(2 / (3000 / 3600))


def test_empty_window_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="window"):
        MetricsRecorder().summary(window_start_s=5.0, window_end_s=5.0)
