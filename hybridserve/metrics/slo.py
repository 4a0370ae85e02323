"""The SLO every run is scored against (DESIGN.md section 6), in one place: the simulator, the
fleet and the load generator (`hybridserve agents`) score a request, and the goodput under the
SLO, with these functions, so a real run and its simulated twin are counted the same way."""

from __future__ import annotations

from hybridserve.metrics.recorder import MetricsRecorder, RequestRecord
from hybridserve.metrics.stats import percentile

TTFT_SLO_S = 15.0  # the SLO tiers of DESIGN.md section 6: TTFT <= 15 s ...
TBT_SLO_S = 0.100  # ... and time between tokens <= 100 ms (p99 within the turn)


def meets_slo(record: RequestRecord) -> bool:
    """Whether a request met both SLO bounds: its first token within TTFT_SLO_S of its arrival,
    and the p99 of its inter-token gaps within TBT_SLO_S."""
    return (
        record.first_token_s is not None
        and record.first_token_s - record.arrival_s <= TTFT_SLO_S
        and (not record.gaps_s or percentile(record.gaps_s, 99) <= TBT_SLO_S)
    )


def slo_goodput(
    recorder: MetricsRecorder, requests_met: int, start_s: float, end_s: float
) -> dict[str, float]:
    """Goodput under the SLO over [start_s, end_s]: requests that met both bounds per second,
    and jobs whose inter-token gaps (all of the job's turns together) kept their p99 within the
    ITL bound per hour (a job's turns wait on tools, so its TTFTs are not its user's wait)."""
    gaps: dict[str, list[float]] = {}
    for r in recorder.requests.values():
        if r.job_id is not None:
            gaps.setdefault(r.job_id, []).extend(r.gaps_s)
    jobs_met = sum(
        1
        for j in recorder.jobs.values()
        if j.finish_s is not None
        and start_s <= j.finish_s <= end_s
        and (not gaps.get(j.job_id) or percentile(gaps[j.job_id], 99) <= TBT_SLO_S)
    )
    window = end_s - start_s
    return {
        "slo_requests_per_s": requests_met / window,
        "slo_jobs_per_hour": jobs_met * 3600.0 / window,
    }
