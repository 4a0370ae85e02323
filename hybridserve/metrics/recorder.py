"""MetricsRecorder: per-request TTFT, ITL and E2E, per-job latency, and job goodput.

ITL is the gap between consecutive output deliveries of a request, as vLLM's serving benchmark
measures it: a step that delivers several accepted speculative tokens is one gap. Job goodput
counts the jobs that finish inside the measurement window, per hour.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridserve.metrics.stats import mean, percentile


@dataclass(slots=True)
class RequestRecord:
    req_id: str
    arrival_s: float
    prompt_tokens: int
    job_id: str | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_s: float | None = None
    output_tokens: int = 0
    hit_tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)


@dataclass(slots=True)
class JobRecord:
    job_id: str
    start_s: float
    finish_s: float | None = None
    turns: int = 0


@dataclass(slots=True)
class TimelineBucket:
    """Steps that ended inside one bucket of simulated time."""

    start_s: float
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    busy_s: float = 0.0
    kv_usage_max: float = 0.0


class Timeline:
    """Prefill and decode tokens per step, and KV usage, over time in fixed buckets (a long
    run keeps a bounded record, whatever its step count)."""

    def __init__(self, bucket_s: float = 1.0) -> None:
        if bucket_s <= 0:
            raise ValueError(f"bucket_s={bucket_s}: use a positive bucket width")
        self.bucket_s = bucket_s
        self.buckets: list[TimelineBucket] = []

    def on_step(
        self, end_s: float, *, duration_s: float, prefill: int, decode: int, kv_usage: float
    ) -> None:
        index = int(end_s // self.bucket_s)
        while len(self.buckets) <= index:
            self.buckets.append(TimelineBucket(len(self.buckets) * self.bucket_s))
        bucket = self.buckets[index]
        bucket.steps += 1
        bucket.prefill_tokens += prefill
        bucket.decode_tokens += decode
        bucket.busy_s += duration_s
        bucket.kv_usage_max = max(bucket.kv_usage_max, kv_usage)

    def rows(self) -> list[dict[str, float]]:
        """One row per bucket: mean prefill/decode tokens per step, steps, max KV usage."""
        return [
            {
                "t_s": b.start_s,
                "steps": float(b.steps),
                "prefill_tokens_per_step": b.prefill_tokens / b.steps if b.steps else 0.0,
                "decode_tokens_per_step": b.decode_tokens / b.steps if b.steps else 0.0,
                "busy_frac": min(1.0, b.busy_s / self.bucket_s),
                "kv_usage_max": b.kv_usage_max,
            }
            for b in self.buckets
        ]


class MetricsRecorder:
    def __init__(self) -> None:
        self.requests: dict[str, RequestRecord] = {}
        self.jobs: dict[str, JobRecord] = {}
        self.preemptions = 0
        self.timeline = Timeline()

    def finished_in(self, window_start_s: float, window_end_s: float) -> list[RequestRecord]:
        """Requests that finished inside [window_start_s, window_end_s]."""
        return [
            r
            for r in self.requests.values()
            if r.finish_s is not None and window_start_s <= r.finish_s <= window_end_s
        ]

    def ttft_samples_s(self, window_start_s: float, window_end_s: float) -> list[float]:
        return [
            r.first_token_s - r.arrival_s
            for r in self.finished_in(window_start_s, window_end_s)
            if r.first_token_s is not None
        ]

    def itl_samples_s(self, window_start_s: float, window_end_s: float) -> list[float]:
        return [g for r in self.finished_in(window_start_s, window_end_s) for g in r.gaps_s]

    def on_arrival(
        self, req_id: str, now: float, prompt_tokens: int, job_id: str | None = None
    ) -> None:
        self.requests[req_id] = RequestRecord(req_id, now, prompt_tokens, job_id)

    def on_admitted(self, req_id: str, hit_tokens: int) -> None:
        record = self.requests.get(req_id)
        if record is not None and record.first_token_s is None:
            record.hit_tokens = hit_tokens

    def on_delivery(self, req_id: str, now: float, num_tokens: int) -> None:
        """A step delivered `num_tokens` (>= 1) tokens of this request at `now`."""
        record = self.requests[req_id]
        if record.first_token_s is None:
            record.first_token_s = now
        elif record.last_token_s is not None:
            record.gaps_s.append(now - record.last_token_s)
        record.last_token_s = now
        record.output_tokens += num_tokens

    def on_finish(self, req_id: str, now: float) -> None:
        self.requests[req_id].finish_s = now

    def on_job_start(self, job_id: str, now: float) -> None:
        self.jobs[job_id] = JobRecord(job_id, now)

    def on_job_turn(self, job_id: str) -> None:
        self.jobs[job_id].turns += 1

    def on_job_finish(self, job_id: str, now: float) -> None:
        self.jobs[job_id].finish_s = now

    def summary(self, *, window_start_s: float, window_end_s: float) -> dict[str, float]:
        """Latency percentiles over requests (and gaps) that finished inside the window."""
        if window_end_s <= window_start_s:
            raise ValueError("the measurement window is empty; run longer or lower the warm-up")
        done = self.finished_in(window_start_s, window_end_s)
        ttft = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]
        e2e = [r.finish_s - r.arrival_s for r in done if r.finish_s is not None]
        gaps = [g for r in done for g in r.gaps_s]
        tpot = [
            (r.finish_s - r.first_token_s) / (r.output_tokens - 1)
            for r in done
            if r.finish_s is not None and r.first_token_s is not None and r.output_tokens > 1
        ]
        jobs = [
            j
            for j in self.jobs.values()
            if j.finish_s is not None and window_start_s <= j.finish_s <= window_end_s
        ]
        hours = (window_end_s - window_start_s) / 3600.0
        prompt = sum(r.prompt_tokens for r in done)
        output = sum(r.output_tokens for r in done)
        job_latency = [j.finish_s - j.start_s for j in jobs if j.finish_s is not None]
        return {
            "requests_completed": float(len(done)),
            "jobs_completed": float(len(jobs)),
            "job_goodput_per_hour": len(jobs) / hours,
            "job_latency_p50_s": percentile(job_latency, 50),
            "ttft_p50_ms": 1000 * percentile(ttft, 50),
            "ttft_p99_ms": 1000 * percentile(ttft, 99),
            "ttft_mean_ms": 1000 * mean(ttft),
            "itl_p50_ms": 1000 * percentile(gaps, 50),
            "itl_p99_ms": 1000 * percentile(gaps, 99),
            "itl_mean_ms": 1000 * mean(gaps),
            "tpot_p50_ms": 1000 * percentile(tpot, 50),
            "tpot_mean_ms": 1000 * mean(tpot),
            "e2e_p50_s": percentile(e2e, 50),
            "e2e_p99_s": percentile(e2e, 99),
            "output_tokens_per_s": output / (window_end_s - window_start_s),
            "prefix_hit_rate": sum(r.hit_tokens for r in done) / prompt if prompt else 0.0,
            "preemptions": float(self.preemptions),
        }
