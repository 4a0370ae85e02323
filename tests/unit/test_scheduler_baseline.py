"""The baseline scheduler and the engine loop: lifecycle, bad input, the finished-id flush."""

from __future__ import annotations

import pytest

from hybridserve.core.config import SchedulingPolicy
from hybridserve.core.errors import RequestError
from hybridserve.core.request import Request, RequestStatus, SamplingParams
from hybridserve.engine import Engine
from hybridserve.kvcache import CacheLayout, FullAttentionSpec, KVCacheManager
from hybridserve.scheduler import Scheduler
from tests.conftest import fake_executor, make_request, make_scheduler


def engine_with(**config: object) -> Engine:
    return Engine(make_scheduler(**config), fake_executor())


def snapshot(engine: Engine) -> tuple[object, ...]:
    scheduler = engine.scheduler
    return (
        sorted(scheduler.requests),
        [r.req_id for r in scheduler.running],
        [r.req_id for r in scheduler.waiting],
        scheduler.cache.num_free_blocks,
    )


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({"req_id": "long", "prompt_token_ids": tuple(range(300))}, "prompt_token_ids"),
        ({"req_id": "prio", "prompt_token_ids": (1, 2), "priority": 3}, "priority"),
    ],
)
def test_bad_requests_are_rejected_and_leave_the_engine_unchanged(
    request_kwargs: dict[str, object], field: str
) -> None:
    engine = engine_with(max_model_len=256, max_num_batched_tokens=512)
    engine.add_request(make_request("ok", 10))
    before = snapshot(engine)
    with pytest.raises(RequestError) as info:
        engine.add_request(Request(sampling=SamplingParams(), **request_kwargs))  # type: ignore[arg-type]
    assert info.value.field == field
    assert snapshot(engine) == before


def test_duplicate_id_and_unknown_abort_are_errors_that_change_nothing() -> None:
    engine = engine_with()
    engine.add_request(make_request("a", 10))
    before = snapshot(engine)
    with pytest.raises(RequestError, match="req_id"):
        engine.add_request(make_request("a", 5))
    with pytest.raises(RequestError, match="no such request"):
        engine.abort("ghost")
    assert snapshot(engine) == before


def test_abort_frees_blocks_and_reports_the_id_next_step() -> None:
    engine = engine_with()
    engine.add_request(make_request("a", 100, max_tokens=50))
    free_idle = engine.scheduler.cache.num_free_blocks
    engine.step()
    assert engine.scheduler.cache.num_free_blocks < free_idle
    engine.abort("a")
    assert engine.scheduler.cache.num_free_blocks == free_idle
    step = engine.step()
    assert step.scheduled.finished_req_ids == ("a",)
    assert not engine.has_requests()


def test_finished_ids_are_flushed_one_step_late_and_the_loop_ends_after_it() -> None:
    engine = engine_with()
    engine.add_request(make_request("a", 20, max_tokens=1))
    first = engine.step()
    assert [o.req_id for o in first.outputs if o.finished] == ["a"]
    assert engine.has_requests()  # the finished id is still to be reported
    second = engine.step()
    assert second.scheduled.finished_req_ids == ("a",) and second.scheduled.is_empty
    assert not engine.has_requests()


def test_chunked_prefill_then_decode_until_max_tokens() -> None:
    engine = engine_with(max_num_batched_tokens=64)
    engine.add_request(make_request("a", 150, max_tokens=3))
    tokens = [
        n for s in (engine.step() for _ in range(6)) for _, n in s.scheduled.num_scheduled_tokens
    ]
    assert tokens == [64, 64, 22, 1, 1]
    request_outputs = engine.scheduler.requests
    assert "a" not in request_outputs


def test_preempted_request_resumes_from_its_own_cached_prefix() -> None:
    scheduler = make_scheduler(block_size=16, num_blocks=12, max_num_batched_tokens=512)
    engine = Engine(scheduler, fake_executor())
    engine.add_request(make_request("a", 64, max_tokens=40))
    engine.add_request(make_request("b", 64, max_tokens=40, base=1000))
    preempted, resumed = [], []
    while engine.has_requests():
        step = engine.step()
        preempted += step.scheduled.preempted
        resumed += step.scheduled.resumed
        scheduler.cache.check_invariants()
    assert preempted and resumed
    assert any(hit > 0 for _, hit in resumed)


def test_priority_policy_admits_the_most_urgent_waiter_first() -> None:
    layout = CacheLayout(groups=(FullAttentionSpec(block_size=16),), num_blocks=256)
    from hybridserve.core.config import SchedulerConfig

    scheduler = Scheduler(
        SchedulerConfig(policy=SchedulingPolicy.PRIORITY, max_num_seqs=1), KVCacheManager(layout)
    )
    engine = Engine(scheduler, fake_executor())
    for req_id, priority in (("low", 5), ("high", 0), ("mid", 2)):
        engine.add_request(
            Request(
                req_id=req_id,
                prompt_token_ids=(1, 2, 3),
                priority=priority,
                sampling=SamplingParams(max_tokens=1, ignore_eos=True),
            )
        )
    order = []
    while engine.has_requests():
        order += [r for r, _ in engine.step().scheduled.new_reqs]
    assert order == ["high", "mid", "low"]


def test_stop_token_finishes_a_request_with_reason_stop() -> None:
    scheduler = make_scheduler()
    engine = Engine(scheduler, fake_executor())  # emits 7, 8, 9, ...
    engine.add_request(
        Request(
            req_id="s",
            prompt_token_ids=(1, 2),
            sampling=SamplingParams(max_tokens=10, stop_token_ids=(9,)),
        )
    )
    outputs = [o for _ in range(5) for o in engine.step().outputs]
    assert [o.new_token_ids for o in outputs] == [(7,), (8,), (9,)]
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop"


def test_plan_carries_full_tables_for_new_requests_and_new_blocks_after() -> None:
    engine = engine_with(max_num_batched_tokens=32)
    engine.add_request(make_request("a", 40, max_tokens=2))
    first = engine.step().scheduled.plan.chunks[0]
    assert first.new_request and len(first.block_ids[0]) == 2 and not first.sample
    second = engine.step().scheduled.plan.chunks[0]
    assert not second.new_request and len(second.block_ids[0]) == 1 and second.sample
    assert second.start == 32 and second.token_ids == tuple(range(32, 40))
    assert engine.scheduler.requests["a"].status is RequestStatus.RUNNING
