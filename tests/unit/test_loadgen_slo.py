"""The load generator scores the SLO as the simulator does: the same requests meet it, and its
report carries the same goodput keys (`slo_requests_per_s`, `slo_jobs_per_hour`), so a real run
and its simulated twin compare on them."""

from __future__ import annotations

import pytest

from hybridserve.loadgen.run import LoadConfig, LoadStats, summarise
from hybridserve.metrics.recorder import MetricsRecorder
from hybridserve.metrics.slo import TBT_SLO_S, TTFT_SLO_S, meets_slo


def _request(rec: MetricsRecorder, req_id: str, arrive: float, ttft: float, gap: float) -> None:
    rec.on_arrival(req_id, arrive, 100)
    now = arrive + ttft
    rec.on_delivery(req_id, now, 1)
    for _ in range(5):
        now += gap
        rec.on_delivery(req_id, now, 1)
    rec.on_finish(req_id, now)


def test_requests_within_both_bounds_are_the_slo_goodput() -> None:
    rec = MetricsRecorder()
    _request(rec, "ok", 10.0, 1.0, 0.05)
    _request(rec, "late", 12.0, TTFT_SLO_S + 1.0, 0.05)  # first token too late
    _request(rec, "slow", 14.0, 1.0, TBT_SLO_S * 2)  # gaps past the ITL bound
    _request(rec, "ok2", 20.0, 2.0, 0.09)
    _request(rec, "warmup", 0.0, 1.0, 0.05)  # finished before the window
    config = LoadConfig(url="http://x", duration_s=60.0, warmup_s=5.0)
    out = summarise(rec, LoadStats(), config)
    met = [r.req_id for r in rec.requests.values() if meets_slo(r)]
    assert met == ["ok", "ok2", "warmup"]
    assert out["slo_attainment"] == pytest.approx(2 / 4)
    assert out["slo_requests_per_s"] == pytest.approx(2 / 55.0)
    assert out["slo_jobs_per_hour"] == 0.0


def test_a_job_counts_when_all_its_gaps_keep_the_bound() -> None:
    rec = MetricsRecorder()
    for job, gap in (("fast", 0.05), ("slow", 0.5)):
        rec.on_job_start(job, 1.0)
        rec.on_arrival(f"{job}-t0", 1.0, 100, job_id=job)
        rec.on_delivery(f"{job}-t0", 1.5, 1)
        rec.on_delivery(f"{job}-t0", 1.5 + gap, 1)
        rec.on_finish(f"{job}-t0", 1.5 + gap)
        rec.on_job_finish(job, 2.0)
    out = summarise(rec, LoadStats(), LoadConfig(url="http://x", duration_s=11.0, warmup_s=1.0))
    assert out["slo_jobs_per_hour"] == pytest.approx(1 * 3600.0 / 10.0)
