"""A finished simulation's summary: what a run reports over its measurement window (the
recorder's metrics, the steps, the waiting queue's trace, where the time went, the SLO goodput,
the cache's and the controls' counters) and `SimRun`, the finished run. The single engine
(`hybridserve.sim.run`) and the fleet (`hybridserve.sim.fleet_report`) summarise through it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.metrics.recorder import MetricsRecorder
from hybridserve.metrics.slo import meets_slo, slo_goodput
from hybridserve.scheduler import Scheduler
from hybridserve.sim.deployment import SimConfig

_STEP_KINDS = ("decode", "prefill", "mixed")


@dataclass(frozen=True, slots=True)
class SimRun:
    """A finished run: the summary over the window, the recorder (samples, timeline) and the
    cache's own counters."""

    config: SimConfig
    summary: dict[str, float]
    recorder: MetricsRecorder
    cache: dict[str, Any]
    rejected: tuple[tuple[str, int, str], ...] = ()  # arrivals refused: id, length, reason
    fleet: dict[str, Any] | None = None  # a fleet's report (hybridserve.sim.fleet_report)
    notices: tuple[str, ...] = ()  # settings the layout could not take (the scheduler's)

    def ttft_samples_s(self) -> list[float]:
        return self.recorder.ttft_samples_s(self.config.warmup_s, self.config.duration_s)

    def itl_samples_s(self) -> list[float]:
        return self.recorder.itl_samples_s(self.config.warmup_s, self.config.duration_s)


class QueueTrace:
    """The waiting queue's length through the measurement window, to tell a run that never
    drains (arrivals outpace service, so latency grows with the window) from a steady one."""

    GROWTH = 2.0  # the last quarter's mean queue exceeds GROWTH x the first quarter's, plus
    MIN_WAITING = 8.0  # MIN_WAITING requests: too many to be noise
    # Or, relative to the arrival rate (a queue that saturated before the window opened): while
    # requests arrived, they were served under SERVED x their rate and fell MIN_WAITING behind.
    SERVED = 0.9

    def __init__(self, window_start_s: float) -> None:
        self.window_start_s = window_start_s
        self.samples: list[tuple[float, int]] = []

    def on_step(self, now: float, num_waiting: int) -> None:
        if now >= self.window_start_s:
            self.samples.append((now, num_waiting))

    def summary(
        self,
        end_s: float,
        recorder: MetricsRecorder | None = None,
        refused: Collection[str] = (),
    ) -> dict[str, float]:
        """The queue's first and last quarter means and whether it never drains; with the
        run's `recorder`, also the window's arrival and service rates (requests per second),
        leaving out the `refused` requests that never finished (they left the queue unserved;
        one refused after its first token, a disaggregated handoff, finished and counts)."""
        span = end_s - self.window_start_s
        first = [w for t, w in self.samples if t < self.window_start_s + span / 4]
        last = [w for t, w in self.samples if self.window_start_s + 3 * span / 4 <= t <= end_s]
        first_mean = sum(first) / len(first) if first else 0.0
        last_mean = sum(last) / len(last) if last else 0.0
        growing = last_mean > self.GROWTH * first_mean + self.MIN_WAITING
        out = {"waiting_first_quarter": first_mean, "waiting_last_quarter": last_mean}
        if recorder is not None:
            rates, backlog = self._rates(recorder, end_s, refused)
            out.update(rates)
            if rates and backlog >= self.MIN_WAITING:
                growing = growing or (
                    rates["service_rate_per_s"] < self.SERVED * rates["arrival_rate_per_s"]
                )
        out["never_drains"] = 1.0 if growing else 0.0
        return out

    def _rates(
        self, recorder: MetricsRecorder, end_s: float, refused: Collection[str]
    ) -> tuple[dict[str, float], int]:
        """The arrival and service rates (requests per second) over the window until its last
        arrival, and the requests left behind then: a finite trace that drains after its
        arrivals end is judged up to its last arrival, not its drain. ({}, 0): too few."""
        start = self.window_start_s
        skip = set(refused)
        arrived = [
            r.arrival_s
            for r in recorder.requests.values()
            if start <= r.arrival_s <= end_s and (r.req_id not in skip or r.finish_s is not None)
        ]
        last = max(arrived, default=start)
        if len(arrived) < 2 or last <= start:
            return {}, 0
        served = len(recorder.finished_in(start, last))
        span = last - start
        rates = {"arrival_rate_per_s": len(arrived) / span, "service_rate_per_s": served / span}
        return rates, len(arrived) - served


def window_end_s(config: SimConfig, ran_until_s: float) -> float:
    """The end of the measurement window: the run's duration, or, for a workload that ran out
    of requests inside the window, when it did (rates are over the time it had work, as
    benchmark tools report them, not over an idle tail)."""
    if config.warmup_s < ran_until_s < config.duration_s:
        return ran_until_s
    return config.duration_s


def window_summary(
    recorder: MetricsRecorder,
    config: SimConfig,
    *,
    end_s: float,
    ran_until_s: float,
    steps: int,
    rejected: Sequence[tuple[str, int, str]],
    jobs_failed: int,
    queue: QueueTrace,
    gpu_seconds: Mapping[str, float],
    ideal_prefix: Mapping[str, int],
) -> dict[str, float]:
    """A finished loop's summary over [warmup, end_s]: the recorder's metrics, the steps, the
    simulated time, the arrivals refused (and the agent jobs they failed), the waiting queue's
    trace and where the time went (`time_breakdown`). Raises ConfigError when no request
    finished in the window."""
    summary = recorder.summary(window_start_s=config.warmup_s, window_end_s=end_s)
    require_completed(summary, config, end_s=end_s, ran_until_s=ran_until_s)
    summary["steps"] = float(steps)
    summary["simulated_s"] = ran_until_s
    summary["requests_rejected"] = float(len(rejected))
    summary["jobs_failed"] = float(jobs_failed)
    summary.update(queue.summary(end_s, recorder, [req_id for req_id, _, _ in rejected]))
    summary.update(time_breakdown(recorder, gpu_seconds, ideal_prefix, config.warmup_s, end_s))
    return summary


def engine_counters(cache: dict[str, Any], schedulers: Sequence[Scheduler]) -> dict[str, float]:
    """The engines' own counters over the whole run: the per-group hit rates of `cache` (the
    engines' cache counters, merged for a fleet), then the pool's blocks and tool-call pinning's
    and the adaptive budget's counters, each summed over the engines."""
    out = group_hit_rates(cache)
    out["kv_cache_blocks"] = float(sum(s.cache.layout.num_blocks for s in schedulers))
    out.update(pin_counters(schedulers))
    out.update(control_counters(schedulers))
    out.update(host_counters(cache, schedulers))
    return out


def host_counters(cache: dict[str, Any], schedulers: Sequence[Scheduler]) -> dict[str, float]:
    """The host tier's counters summed over the engines (none without a tier): its blocks,
    the hit tokens it served (`host_hit_rate` over the queried tokens) and its copies."""
    out: dict[str, float] = {}
    for scheduler in schedulers:
        snapshot = scheduler.cache.metrics_snapshot().get("host")
        if not isinstance(snapshot, dict):
            continue
        for name, value in snapshot.items():
            if name != "used_slots":
                key = "host_blocks" if name == "slots" else f"host_{name}"
                out[key] = out.get(key, 0.0) + float(value)
    if out:
        queried = cache["queried_tokens"]
        out["host_hit_rate"] = out["host_hit_tokens"] / queried if queried else 0.0
    return out


def pin_counters(schedulers: Sequence[Scheduler]) -> dict[str, float]:
    """Tool-call pinning's counters summed over the engines (none when pinning is off)."""
    out: dict[str, float] = {}
    for scheduler in schedulers:
        if scheduler.pinning:
            for name, value in dataclasses.asdict(scheduler.cache.pin_stats).items():
                out[f"kv_pins_{name}"] = out.get(f"kv_pins_{name}", 0.0) + float(value)
    return out


def control_counters(schedulers: Sequence[Scheduler]) -> dict[str, float]:
    """The adaptive budget's counters summed over the engines (none when it is off): the mixed
    steps planned with its queue valve open, those it stood aside for (its decodes alone ran past
    its target), and the budget each engine ended on; with a
    waiting deadline, the requests that waited past it."""
    out: dict[str, float] = {}
    for scheduler in schedulers:
        adaptive = scheduler.controls.adaptive
        if adaptive is not None:
            for name, value in (
                ("adaptive_queue_pressure_steps", scheduler.controls.stats.queue_pressure_steps),
                (
                    "adaptive_stand_aside_steps",
                    scheduler.controls.stats.adaptive_stand_aside_steps,
                ),
                ("adaptive_budget_tokens_at_end", adaptive.tokens()),
            ):
                out[name] = out.get(name, 0.0) + float(value)
        if scheduler.deadline_queue is not None:
            demoted = float(scheduler.deadline_queue.num_demoted)
            out["requests_past_deadline"] = out.get("requests_past_deadline", 0.0) + demoted
    return out


def require_completed(
    summary: dict[str, float], config: SimConfig, *, end_s: float, ran_until_s: float
) -> None:
    """A window in which no request finished has no latency to report: an error, with the fix,
    never a report of nulls."""
    if summary["requests_completed"] > 0:
        return
    raise ConfigError(
        "warmup_s (--warmup)",
        config.warmup_s,
        f"no request finished inside the measurement window [{config.warmup_s:g}, "
        f"{end_s:g}] s (the run had work until {ran_until_s:.1f} s); lower --warmup "
        "(a finite workload's default is 0) or raise --duration",
    )


def time_breakdown(
    recorder: MetricsRecorder,
    gpu_seconds: Mapping[str, float],
    ideal_prefix: Mapping[str, int],
    start_s: float,
    end_s: float,
) -> dict[str, float]:
    """Where the time goes over [start_s, end_s]: GPU time by kind of step (fractions of the
    window), job time (jobs finished in the window) in decode, tool wait and queue + TTFT, the
    prompt tokens each turn recomputed against an ideal cache's, and the SLO attainment."""
    window = end_s - start_s
    out = {f"gpu_{kind}_frac": gpu_seconds.get(kind, 0.0) / window for kind in _STEP_KINDS}
    out["gpu_busy_frac"] = sum(out.values())
    jobs = {
        j.job_id: j.finish_s - j.start_s
        for j in recorder.jobs.values()
        if j.finish_s is not None and start_s <= j.finish_s <= end_s
    }
    decode = queue = 0.0
    for r in recorder.requests.values():
        if r.job_id in jobs and r.finish_s is not None and r.first_token_s is not None:
            decode += r.finish_s - r.first_token_s
            queue += r.first_token_s - r.arrival_s
    total = sum(jobs.values())
    out["job_decode_frac"] = decode / total if total else math.nan
    out["job_queue_ttft_frac"] = queue / total if total else math.nan
    out["job_tool_frac"] = (total - decode - queue) / total if total else math.nan
    done = recorder.finished_in(start_s, end_s)
    recomputed = [r.prompt_tokens - r.hit_tokens for r in done]
    ideal = [r.prompt_tokens - ideal_prefix.get(r.req_id, 0) for r in done]
    out["recomputed_prompt_tokens_per_turn"] = statistics.fmean(recomputed) if done else math.nan
    out["ideal_prompt_tokens_per_turn"] = statistics.fmean(ideal) if done else math.nan
    met = [r for r in done if meets_slo(r)]
    out["slo_attainment"] = len(met) / len(done) if done else math.nan
    out.update(slo_goodput(recorder, len(met), start_s, end_s))
    return out


def group_hit_rates(cache: dict[str, Any]) -> dict[str, float]:
    """Per-group offered hit tokens over queried tokens, over the whole run (the cache counts
    from the start): `group{g}_{kind}_hit_rate`. The reconciled rate is `prefix_hit_rate`."""
    queried = cache["queried_tokens"]
    return {
        f"group{g['group']}_{g['kind']}_hit_rate": g["offered_hit_tokens"] / queried
        if queried
        else 0.0
        for g in cache["groups"]
    }


def rounded(value: Any) -> Any:
    """A report rounded as the metrics are (4 places; an undefined value, NaN, becomes None)."""
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 4)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value
