"""The waiting queue's first-token deadline (scheduler/queue.py DeadlineQueue): below it the
order is vLLM's FCFS; a request that waited past it goes behind every request that has not; it
never loses or repeats a request; and it is off unless asked for (so `baseline` stays vLLM's)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.core.config import SchedulerConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import StepResult
from hybridserve.engine.settings import WAITING_DEADLINE_MS, preset
from hybridserve.scheduler.queue import DeadlineQueue, FcfsQueue
from tests.conftest import make_request, make_scheduler


def _ids(queue: DeadlineQueue | FcfsQueue) -> list[str]:
    return [request.req_id for request in queue]


def test_within_the_deadline_the_order_is_fcfs_with_preempted_requests_first() -> None:
    deadline, fcfs = DeadlineQueue(10.0), FcfsQueue()
    for queue in (deadline, fcfs):
        for i in range(4):
            queue.add(make_request(f"r{i}", 4, arrival=float(i)))
        queue.prepend(make_request("preempted", 4, arrival=-5.0))
    deadline.advance(4.0)  # r0 has waited 4 s of 10
    assert _ids(deadline) == _ids(fcfs) == ["preempted", "r0", "r1", "r2", "r3"]
    assert deadline.num_demoted == 0


def test_a_request_that_waited_past_the_deadline_goes_behind_those_that_did_not() -> None:
    queue = DeadlineQueue(10.0)
    for i, arrival in enumerate((0.0, 1.0, 2.0, 9.0)):
        queue.add(make_request(f"r{i}", 4, arrival=arrival))
    queue.advance(11.0)  # r0 (11 s) and r1 (10 s) are late; r2 (9 s) and r3 are not
    assert _ids(queue) == ["r2", "r3", "r0", "r1"]  # the late keep their arrival order
    assert queue.peek().req_id == "r2" and queue.num_demoted == 2
    queue.prepend(make_request("preempted", 4, arrival=0.0))
    assert queue.pop().req_id == "preempted"  # a preempted request still resumes first
    queue.advance(30.0)
    assert _ids(queue) == ["r0", "r1", "r2", "r3"]  # all late: arrival order again
    queue.remove(queue.peek())
    assert _ids(queue) == ["r1", "r2", "r3"]
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove(make_request("stranger", 4))


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "prepend", "advance", "pop", "remove"]), st.floats(0, 5)),
        max_size=60,
    )
)
def test_the_queue_never_loses_or_repeats_a_request(ops: list[tuple[str, float]]) -> None:
    queue, held, now, n = DeadlineQueue(3.0), [], 0.0, 0
    for op, x in ops:
        if op in ("add", "prepend"):
            now += x
            request = make_request(f"r{n}", 4, arrival=now)
            n += 1
            (queue.add if op == "add" else queue.prepend)(request)
            held.append(request.req_id)
        elif op == "advance":
            now += x
            queue.advance(now)
        elif held and op == "pop":
            held.remove(queue.pop().req_id)
        elif held:
            victim = list(queue)[int(x) % len(held)]
            queue.remove(victim)
            held.remove(victim.req_id)
        assert sorted(_ids(queue)) == sorted(held) and len(queue) == len(held)
        assert bool(queue) == bool(held)
        if held:
            assert queue.peek() is next(iter(queue))


def test_it_is_off_by_default_and_in_the_vllm_presets_and_on_in_the_shipped_one() -> None:
    assert SchedulerConfig().waiting_deadline_ms == 0
    assert make_scheduler().deadline_queue is None
    for name in ("baseline", "legacy"):
        assert preset(name, quantum=544, max_model_len=131_072).scheduler.waiting_deadline_ms == 0
    shipped = preset("hybridserve", quantum=544, max_model_len=131_072).scheduler
    assert shipped.waiting_deadline_ms == WAITING_DEADLINE_MS > 0


def test_a_deadline_is_refused_beside_another_queue_order_or_below_zero() -> None:
    with pytest.raises(ConfigError, match="waiting_deadline_ms"):
        SchedulerConfig(waiting_deadline_ms=5000.0, policy="priority")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="waiting_deadline_ms"):
        SchedulerConfig(waiting_deadline_ms=5000.0, program_priority="plas")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="waiting_deadline_ms"):
        SchedulerConfig(waiting_deadline_ms=-1.0)


def _first_tokens(**config: object) -> dict[str, float]:
    """One request's whole prefill per step (8 tokens of budget, 8-token prompts), a new request
    every 0.5 s and steps of 1 s: twice the arrivals the engine can serve. Each request's time
    to first token."""
    scheduler = make_scheduler(max_num_batched_tokens=8, **config)
    first: dict[str, float] = {}
    arrivals = [
        make_request(f"r{i}", 8, max_tokens=1, base=100 * i, arrival=0.5 * i) for i in range(40)
    ]
    now = 0.0
    for _ in range(40):
        while arrivals and arrivals[0].arrival_time <= now:
            scheduler.add_request(arrivals.pop(0))
        out = scheduler.schedule(now)
        now += 1.0
        sampled = {c.req_id: (7,) for c in out.plan.chunks if c.sample}
        for req_id in sampled:
            first.setdefault(req_id, now - scheduler.requests[req_id].arrival_time)
        scheduler.update(out, StepResult(out.plan.step_id, sampled, 1.0))
    return first


def test_past_saturation_the_deadline_serves_requests_that_can_still_meet_it() -> None:
    fcfs = _first_tokens()
    ordered = _first_tokens(waiting_deadline_ms=5_000.0)
    assert len(ordered) == len(fcfs)  # the same work done: only the order moved
    within = sum(1 for t in ordered.values() if t <= 6.0)
    assert within > 2 * sum(1 for t in fcfs.values() if t <= 6.0)
    snapshot = make_scheduler(waiting_deadline_ms=5_000.0).metrics_snapshot()
    assert snapshot["hybridserve:scheduler_requests_past_deadline_total"] == 0
    assert "hybridserve:scheduler_requests_past_deadline_total" not in (
        make_scheduler().metrics_snapshot()
    )


def test_a_simulated_runs_summary_counts_the_requests_past_the_deadline_only_when_it_is_on() -> (
    None
):
    from hybridserve.sim.summary import control_counters

    on = make_scheduler(waiting_deadline_ms=1_000.0)
    on.add_request(make_request("late", 8, arrival=0.0))
    on.deadline_queue.advance(2.0)  # type: ignore[union-attr]
    assert control_counters([on, on]) == {"requests_past_deadline": 2.0}
    assert "requests_past_deadline" not in control_counters([make_scheduler()])
