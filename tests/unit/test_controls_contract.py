"""The controls' contract: a frozen decision, a pure decision, state advanced only on commit and
observe, one prefill-end rule, one priority rule and typed finish reasons."""

from __future__ import annotations

import dataclasses

import pytest

from hybridserve.core.config import SchedulerConfig, SchedulingPolicy
from hybridserve.core.errors import RequestError
from hybridserve.core.request import FinishReason, Request, RequestStatus, SamplingParams
from hybridserve.engine import Engine
from hybridserve.scheduler.controls import (
    UNLIMITED,
    PrefillAllowance,
    PrefillController,
    PrefillDecision,
    count_partials,
    is_decode,
)
from hybridserve.scheduler.step import StepState
from hybridserve.scheduler.step_model import StepTimeModel
from tests.conftest import fake_executor, make_request, make_scheduler


def running_request(req_id: str, prompt: int, computed: int) -> Request:
    request = Request(
        req_id=req_id, prompt_token_ids=tuple(range(prompt)), sampling=SamplingParams()
    )
    request.transition(RequestStatus.RUNNING)
    request.num_computed_tokens = computed
    if computed >= prompt:
        request.append_output_tokens([1])
    return request


def rotating_controller() -> tuple[PrefillController, dict[str, object]]:
    ctl = PrefillController(SchedulerConfig(max_num_prefill_tokens_per_step=8), quantum=1)
    running = [running_request("d", 10, 10), *(running_request(n, 500, 0) for n in "abc")]
    args: dict[str, object] = {
        "now": 0.0,
        "running": running,
        "waiting": [],
        "token_budget": 99,
        "seq_slot_free": False,
    }
    return ctl, args


def test_the_decision_is_frozen_and_its_grants_cannot_be_changed() -> None:
    ctl, args = rotating_controller()
    decision = ctl.decide(**args)  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.allow_prefill = False  # type: ignore[misc]
    assert decision.grants is not None
    with pytest.raises(TypeError):
        decision.grants["a"] = 99  # type: ignore[index]


def test_no_limit_is_a_value_not_an_identity() -> None:
    assert UNLIMITED.unlimited and PrefillDecision().unlimited
    assert dataclasses.replace(UNLIMITED, pending=True).unlimited  # a record, not a limit
    assert not PrefillDecision(allow_prefill=False).unlimited
    assert not PrefillDecision(grants={"a": 1}).unlimited
    assert not PrefillDecision(waiter_tokens=16).unlimited
    assert not PrefillDecision(max_partials=2).unlimited


def test_grant_caps_a_partial_by_its_grant_and_stops_it_in_a_burst() -> None:
    assert UNLIMITED.grant("a", 700) == 700
    assert PrefillDecision(grants={"a": 256}).grant("a", 700) == 256
    assert PrefillDecision(grants={"a": 256}).grant("b", 700) == 0
    assert PrefillDecision(allow_prefill=False).grant("a", 700) == 0


def test_decide_is_pure_and_commit_advances_the_rotation() -> None:
    ctl, args = rotating_controller()
    first = ctl.decide(**args)  # type: ignore[arg-type]
    again = ctl.decide(**args)  # type: ignore[arg-type]
    assert first == again and ctl.rot == 0 and ctl.stats.last_grants == {}
    ctl.commit(first)
    assert ctl.rot == first.rotation == 2 and ctl.stats.last_grants == {"a": 3, "b": 3, "c": 2}
    after = ctl.decide(**args)  # type: ignore[arg-type]
    assert after.grants == {"c": 3, "a": 3, "b": 2}


def test_decide_and_commit_commits_what_it_decides() -> None:
    ctl, args = rotating_controller()
    twin, _ = rotating_controller()
    expected = twin.decide(**args)  # type: ignore[arg-type]
    assert ctl.decide_and_commit(**args) == expected  # type: ignore[arg-type]
    assert ctl.rot == expected.rotation


def test_an_adaptive_fallback_is_counted_on_commit_only() -> None:
    model = StepTimeModel(seed_coefficients=(0.001, 0.0, 0.0, 0.0))
    for i in range(8):  # 1 ms, then 100 ms for the same shape: the model's error is large
        model.update(model.features(1, 0, 0), 0.1 if i % 2 else 0.001)
    ctl = PrefillController(SchedulerConfig(target_mixed_step_ms=20.0), quantum=1, step_model=model)
    decision = ctl.decide(
        now=0,
        running=[running_request("d", 10, 10), running_request("p", 900, 0)],
        waiting=[],
        token_budget=8192,
        seq_slot_free=False,
    )
    assert decision.adaptive_fallback and ctl.stats.adaptive_fallbacks == 0
    ctl.commit(decision)
    assert ctl.stats.adaptive_fallbacks == 1


def test_every_enabled_decision_carries_the_partial_prefill_bound() -> None:
    ctl = PrefillController(SchedulerConfig(max_num_partial_prefills=2), quantum=1)
    for running in ([], [running_request("p", 50, 0)], [running_request("d", 10, 10)]):
        decision = ctl.decide(
            now=0, running=running, waiting=[], token_budget=64, seq_slot_free=True
        )
        assert decision.max_partials == 2 and decision.grants is None


def test_allowance_bounds_partials_and_spends_the_waiter_tokens() -> None:
    decision = PrefillDecision(grants={}, waiter_tokens=32, max_partials=1)
    step = StepState(budget=64, threshold=0, decision=decision)
    allowance = step.prefill
    assert isinstance(allowance, PrefillAllowance)
    assert allowance.admission_tokens(100) == 32
    partial = running_request("p", 500, 0)
    assert not allowance.admits(completes=False, running=[partial], step=step)
    assert allowance.admits(completes=True, running=[partial], step=step)
    assert allowance.admits(completes=False, running=[], step=step)
    allowance.charge(32, completes=False)
    assert allowance.waiter_tokens == 0 and allowance.new_partials == 1
    assert allowance.admission_tokens(100) == 0
    assert not allowance.admits(completes=False, running=[], step=step)


def test_reclaim_gives_unused_waiter_tokens_to_partials_in_running_order() -> None:
    decision = PrefillDecision(grants={"a": 0, "b": 0}, waiter_tokens=20)
    step = StepState(budget=64, threshold=0, decision=decision)
    running = [running_request("d", 10, 10), running_request("a", 12, 0)]
    running.append(running_request("b", 50, 0))
    taken: list[tuple[str, int, int]] = []

    def take_more(request: Request, already: int, total: int) -> int | None:
        taken.append((request.req_id, already, total))
        return total - already

    step.prefill.reclaim(running, step, take_more)
    assert taken == [("a", 0, 12), ("b", 0, 8)]  # "a" needs 12 of the 20, "b" gets the rest
    assert step.prefill.waiter_tokens == 0


def test_reclaim_does_nothing_without_grants_or_when_blocks_run_out() -> None:
    running = [running_request("a", 50, 0), running_request("b", 50, 0)]
    calls: list[str] = []

    def no_room(request: Request, already: int, total: int) -> int | None:
        calls.append(request.req_id)
        return None

    free = StepState(budget=64, threshold=0, decision=PrefillDecision(waiter_tokens=20))
    free.prefill.reclaim(running, free, no_room)
    assert calls == []
    step = StepState(budget=64, threshold=0, decision=PrefillDecision(grants={}, waiter_tokens=20))
    step.prefill.reclaim(running, step, no_room)
    assert calls == ["a"] and step.prefill.waiter_tokens == 20


def test_prefill_end_is_the_prompt_end_then_all_but_the_last_token_after_outputs() -> None:
    request = make_request("r", 10)
    assert request.prefill_end == 10
    request.append_output_tokens([5])
    assert request.prefill_end == 10
    request.append_output_tokens([6, 7])
    assert request.prefill_end == 12  # a recompute covers all but the last output
    request.num_computed_tokens = 11
    assert not is_decode(request)
    request.num_computed_tokens = 12
    assert is_decode(request) and count_partials([request, make_request("w", 4)]) == 1


def test_the_fcfs_policy_takes_priority_zero_only() -> None:
    with pytest.raises(RequestError) as info:
        SchedulerConfig().check_priority(1)
    assert info.value.field == "priority" and info.value.value == 1
    SchedulerConfig().check_priority(0)
    SchedulerConfig(policy=SchedulingPolicy.PRIORITY).check_priority(3)


def test_a_finished_output_carries_its_finish_reason_as_the_enum() -> None:
    engine = Engine(make_scheduler(), fake_executor())  # emits 7, 8, 9, ...
    engine.add_request(
        Request(
            req_id="s",
            prompt_token_ids=(1, 2),
            sampling=SamplingParams(max_tokens=10, stop_token_ids=(8,)),
        )
    )
    engine.add_request(make_request("n", 4, max_tokens=2, base=100))
    outputs = [o for _ in range(6) for o in engine.step().outputs]
    reasons = {o.req_id: o.finish_reason for o in outputs if o.finished}
    assert reasons == {"s": FinishReason.STOP, "n": FinishReason.LENGTH}
    assert all(o.finish_reason is None for o in outputs if not o.finished)
