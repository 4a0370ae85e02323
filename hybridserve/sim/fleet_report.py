"""A finished fleet's summary and report (`fleet_run`): the single-engine summary's keys,
fleet-wide (`hybridserve.sim.summary`), and the fleet's own report over the measurement window:
routing, the reconciled hit rate against the global ideal, the load imbalance (max/mean over
replicas of the time-averaged outstanding tokens), SLO goodput per GPU, each replica's share and
the prefill/decode handoffs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridserve.metrics.recorder import RequestRecord
from hybridserve.metrics.slo import meets_slo
from hybridserve.metrics.stats import percentile
from hybridserve.sim.fleet import FleetSimulation
from hybridserve.sim.summary import (
    SimRun,
    engine_counters,
    window_end_s,
    window_summary,
)


@dataclass(frozen=True, slots=True)
class FleetRun:
    """A finished fleet run: the fleet-wide summary (the single-engine keys) and the fleet
    report (`fleet_run`)."""

    run: SimRun
    fleet: dict[str, Any]


def imbalance(loads: list[float]) -> float:
    """max/mean of the replicas' loads: 1.0 when balanced (or when there is no load)."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0


def _latency(records: list[RequestRecord]) -> dict[str, float]:
    ttft = [r.first_token_s - r.arrival_s for r in records if r.first_token_s is not None]
    gaps = [g for r in records for g in r.gaps_s]
    return {
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p99_ms": 1000 * percentile(ttft, 99),
        "itl_p50_ms": 1000 * percentile(gaps, 50),
        "itl_p99_ms": 1000 * percentile(gaps, 99),
    }


def _hit_rate(records: list[RequestRecord], hits: Mapping[str, int] | None = None) -> float:
    prompt = sum(r.prompt_tokens for r in records)
    if hits is None:
        hit = sum(r.hit_tokens for r in records)
    else:
        hit = sum(hits.get(r.req_id, 0) for r in records)
    return hit / prompt if prompt else 0.0


def fleet_run(sim: FleetSimulation) -> FleetRun:
    """The finished fleet's run: the summary has the single-engine keys, fleet-wide."""
    config, fleet, recorder = sim.config, sim.fleet, sim.recorder
    start = config.warmup_s
    end_s = window_end_s(config, sim.now)
    summary = window_summary(
        recorder,
        config,
        end_s=end_s,
        ran_until_s=sim.now,
        steps=sim.steps,
        rejected=sim.sim.rejected,
        jobs_failed=sim.sim.jobs_failed,
        queue=sim.queue,
        gpu_seconds=sim.gpu_seconds,
        ideal_prefix=sim.ideal,
    )
    # GPU fractions are of the fleet's GPU time: N replicas give N x the window.
    for key in [k for k in summary if k.startswith("gpu_") and k.endswith("_frac")]:
        summary[key] /= fleet.replicas
    caches = [r.scheduler.cache.metrics_snapshot() for r in sim.replicas]
    cache = caches[0] if fleet.replicas == 1 else _merged_cache(caches)
    summary.update(engine_counters(cache, [r.scheduler for r in sim.replicas]))
    report = _fleet_report(sim, summary, start=start, end_s=end_s)
    notices = tuple(dict.fromkeys(n for r in sim.replicas for n in r.scheduler.notices))
    run = SimRun(
        config,
        summary,
        recorder,
        cache,
        rejected=tuple(sim.sim.rejected),
        fleet=report,
        notices=notices,
    )
    return FleetRun(run, report)


def _fleet_report(
    sim: FleetSimulation, summary: dict[str, float], *, start: float, end_s: float
) -> dict[str, Any]:
    """The fleet's own report: routing, hit rate against the global ideal, balance, SLO
    goodput per GPU, each replica's share and the P/D handoffs."""
    fleet, config = sim.fleet, sim.config
    done = sim.recorder.finished_in(start, end_s)
    loads = sim.mean_outstanding(end_s)
    hours = (end_s - start) / 3600.0
    hit = _hit_rate(done)
    ideal = _hit_rate(done, sim.global_ideal)
    gpus = fleet.replicas * config.tp
    within = [r for r in done if meets_slo(r)]
    report: dict[str, Any] = {
        "replicas": fleet.replicas,
        "gpus": gpus,
        "router": fleet.router,
        "router_view": fleet.view,
        "load_weight": fleet.load_weight,
        "junction_weight": fleet.junction_weight,
        "hit_rate": hit,
        "global_ideal_hit_rate": ideal,
        "hit_rate_of_ideal": hit / ideal if ideal else math.nan,
        "imbalance": imbalance(loads),
        # Requests within the SLO (TTFT <= 15 s, p99 gap <= 100 ms) per GPU-hour.
        "slo_requests_per_gpu_hour": len(within) / hours / gpus,
        "job_goodput_per_gpu_hour": summary["job_goodput_per_hour"] / gpus,
        "per_replica": _per_replica(sim, done, loads, start=start, end_s=end_s),
    }
    if fleet.pd is not None:
        report["pd"] = _pd_report(sim, fleet.pd)
    return report


def _per_replica(
    sim: FleetSimulation,
    done: list[RequestRecord],
    loads: list[float],
    *,
    start: float,
    end_s: float,
) -> list[dict[str, Any]]:
    """Each replica's share of the window: its requests, jobs, latencies, hits and load."""
    fleet, recorder = sim.fleet, sim.recorder
    hours = (end_s - start) / 3600.0
    out = []
    for index, replica in enumerate(sim.replicas):
        mine = [
            r for r in done if index in (sim.replica_of.get(r.req_id), sim.decode_of.get(r.req_id))
        ]
        jobs = [
            j
            for j in recorder.jobs.values()
            if j.finish_s is not None
            and start <= j.finish_s <= end_s
            and sim.job_replica.get(j.job_id) == index
        ]
        out.append(
            {
                "replica": index,
                "role": "colocated"
                if fleet.pd is None
                else ("prefill" if index < sim.num_prefill else "decode"),
                "requests_completed": float(len(mine)),
                "job_goodput_per_hour": len(jobs) / hours,
                **_latency(mine),
                "hit_rate": _hit_rate(mine),
                "mean_outstanding_tokens": loads[index],
                "gpu_busy_frac": replica.busy_s / (end_s - start),
                "steps": float(replica.steps),
            }
        )
    return out


def _pd_report(sim: FleetSimulation, pd: tuple[int, int]) -> dict[str, Any]:
    """The prefill/decode split's handoffs over the window."""
    moves = sim.transfer_s
    return {
        "prefill": pd[0],
        "decode": pd[1],
        "link": sim.link.name,
        "link_gb_per_s": sim.link.bytes_per_s / 1e9,
        "handoffs": len(moves),
        "transferred_gb_per_gpu": sim.transfer_bytes / 1e9,
        "transfer_ms_mean": 1000 * sum(moves) / len(moves) if moves else math.nan,
        "transfer_ms_p99": 1000 * percentile(moves, 99) if moves else math.nan,
    }


def _merged_cache(caches: list[dict[str, Any]]) -> dict[str, Any]:
    """The replicas' cache counters summed (per group: offered hit tokens; queried tokens)."""
    merged: dict[str, Any] = {
        "queried_tokens": sum(c["queried_tokens"] for c in caches),
        "groups": [
            {
                **group,
                "offered_hit_tokens": sum(c["groups"][g]["offered_hit_tokens"] for c in caches),
            }
            for g, group in enumerate(caches[0]["groups"])
        ],
    }
    return merged
