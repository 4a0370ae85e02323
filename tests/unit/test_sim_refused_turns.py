"""A turn the engine refuses (a context the whole KV pool cannot hold) is counted and its agent
goes on, as `agents --url` does with a failed request: the run is never cut short by an agent
that waits forever, on one engine or on a fleet, and a refused request is not a queue that
never drains."""

from __future__ import annotations

from collections import defaultdict

import pytest

from hybridserve.metrics.recorder import MetricsRecorder
from hybridserve.sim.deployment import FleetConfig, SimConfig
from hybridserve.sim.run import run_fleet, run_simulation
from hybridserve.sim.summary import QueueTrace
from hybridserve.sim.workload import AgentParams

# 12 blocks of Qwen3-Next's 544 tokens: contexts past ~6k tokens can never start.
SMALL_POOL = SimConfig(
    agents=AgentParams(num_agents=3, system_prompt_tokens=1_000),
    duration_s=200.0,
    warmup_s=0.0,
    num_gpu_blocks_override=12,
)


def _turns_after_refusal(recorder: MetricsRecorder, refused: list[str]) -> dict[str, int]:
    """Per agent that had a turn refused: how many of its requests arrived after the first."""
    first: dict[str, float] = {}
    for req_id in refused:
        record = recorder.requests[req_id]
        agent = req_id.split(".")[0]
        first[agent] = min(first.get(agent, record.arrival_s), record.arrival_s)
    later: dict[str, int] = defaultdict(int)
    for req_id, record in recorder.requests.items():
        agent = req_id.split(".")[0]
        if agent in first and record.arrival_s > first[agent]:
            later[agent] += 1
    return {agent: later[agent] for agent in first}


def test_an_agent_whose_turn_is_refused_goes_on_and_its_job_counts_as_failed() -> None:
    run = run_simulation(SMALL_POOL)
    summary = run.summary
    refused = [req_id for req_id, _, _ in run.rejected]
    assert refused and all("cannot start" in why for _, _, why in run.rejected)
    assert summary["requests_rejected"] == len(refused)
    # Every refused agent sent more turns after its first refusal (its job went on with drawn
    # answers, then it started new jobs), and the run lasted its whole duration.
    later = _turns_after_refusal(run.recorder, refused)
    assert later and all(count > 0 for count in later.values())
    assert summary["simulated_s"] >= SMALL_POOL.duration_s
    assert summary["jobs_failed"] >= 1
    # A failed job is not a finished one: no job with a refused turn counts toward goodput.
    failed_jobs = {req_id.rsplit(".", 1)[0] for req_id in refused}
    finished = {j for j, job in run.recorder.jobs.items() if job.finish_s is not None}
    assert not failed_jobs & finished
    # Refused turns leave the queue at once: the run is not reported as never draining.
    assert summary["never_drains"] == 0.0


def test_a_refused_turn_on_a_fleet_replica_is_dropped_from_its_load_and_the_agent_goes_on() -> None:
    run = run_fleet(SMALL_POOL, FleetConfig(replicas=2, router="least-loaded")).run
    refused = [req_id for req_id, _, _ in run.rejected]
    assert refused and run.summary["jobs_failed"] >= 1
    later = _turns_after_refusal(run.recorder, refused)
    assert later and all(count > 0 for count in later.values())
    assert run.summary["simulated_s"] >= SMALL_POOL.duration_s


def test_the_same_seed_gives_the_same_refusals_and_failed_jobs() -> None:
    one, two = run_simulation(SMALL_POOL), run_simulation(SMALL_POOL)
    assert one.rejected == two.rejected
    assert one.summary == pytest.approx(two.summary, nan_ok=True)


def test_refused_requests_are_not_a_backlog_that_never_drains() -> None:
    # 100 requests at 1/s; the even ones served at once, the odd ones refused at arrival.
    recorder, queue = MetricsRecorder(), QueueTrace(0.0)
    for i in range(100):
        recorder.on_arrival(f"r{i}", float(i), 100)
        if i % 2 == 0:
            recorder.on_finish(f"r{i}", i + 0.5)
        queue.on_step(float(i), 0)
    refused = [f"r{i}" for i in range(1, 100, 2)]
    assert queue.summary(100.0, recorder)["never_drains"] == 1.0  # read as a backlog of 50
    kept = queue.summary(100.0, recorder, refused)
    assert kept["never_drains"] == 0.0
    assert kept["arrival_rate_per_s"] == pytest.approx(kept["service_rate_per_s"], rel=0.05)
    # A refused request that finished anyway (a disaggregated handoff's answer cut short) is
    # an arrival that was served: it stays in both rates.
    finished_refused = queue.summary(100.0, recorder, ["r0", *refused])
    assert finished_refused["arrival_rate_per_s"] == kept["arrival_rate_per_s"]
