"""Executor faults end the requests of the step that caused them, never the engine."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hybridserve.core.plan import StepPlan, StepResult
from hybridserve.engine import Engine, StepFailed
from hybridserve.executor.fake import FakeExecutor
from tests.conftest import fake_executor, make_request, make_scheduler


class FlakyExecutor:
    """A fake executor that raises on the steps `fail_on` accepts; records every plan."""

    def __init__(self, fail_on: Callable[[int], bool], inner: FakeExecutor | None = None) -> None:
        self.inner = inner or fake_executor()
        self.fail_on = fail_on
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        if self.fail_on(plan.step_id):
            raise RuntimeError("device lost")
        return self.inner.execute(plan)


def _run(engine: Engine, outputs: dict[str, list[int]], max_steps: int = 200) -> list[StepFailed]:
    failures = []
    for _ in range(max_steps):
        if not engine.has_requests():
            return failures
        try:
            step = engine.step()
        except StepFailed as exc:
            failures.append(exc)
            continue
        for out in step.outputs:
            outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
    raise AssertionError("the engine did not drain")


def test_executor_exception_aborts_that_steps_requests_and_the_rest_complete() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64, num_blocks=64)
    executor = FlakyExecutor(lambda step_id: step_id == 3)
    engine = Engine(scheduler, executor)
    for i in range(6):
        engine.add_request(make_request(f"r{i}", 40, max_tokens=5, base=100 * i))
    outputs: dict[str, list[int]] = {}
    failures = _run(engine, outputs)
    assert len(failures) == 1
    failed = set(failures[0].req_ids)
    assert failed == {c.req_id for c in executor.plans[3].chunks}
    assert isinstance(failures[0].__cause__, RuntimeError)
    for i in range(6):
        if f"r{i}" not in failed:
            assert outputs[f"r{i}"] == [7, 8, 9, 10, 11]
    scheduler.cache.check_invariants()
    assert scheduler.cache.num_free_blocks == scheduler.cache.layout.num_blocks - 1
    assert not scheduler.requests


def test_finished_ids_a_failed_step_carried_reach_the_executor_with_the_next_plan() -> None:
    scheduler = make_scheduler(num_blocks=64)
    executor = FlakyExecutor(lambda step_id: step_id == 2)
    engine = Engine(scheduler, executor)
    engine.add_request(make_request("short", 8, max_tokens=2))  # finishes in step 1
    engine.add_request(make_request("long", 8, max_tokens=20, base=50))
    _run(engine, {})
    assert "short" in executor.plans[2].finished_req_ids
    assert "short" in executor.plans[3].finished_req_ids
    assert "long" in executor.plans[3].finished_req_ids  # aborted by the failed step


def test_blocks_of_a_failed_step_leave_the_prefix_cache() -> None:
    scheduler = make_scheduler(num_blocks=64)
    engine = Engine(scheduler, FlakyExecutor(lambda step_id: step_id == 0))
    engine.add_request(make_request("first", 64, max_tokens=2))
    with pytest.raises(StepFailed):
        engine.step()
    engine.add_request(make_request("again", 64, max_tokens=2))
    step = engine.step()
    assert step.scheduled.new_reqs == (("again", 0),)  # no hit on the unwritten blocks
    scheduler.cache.check_invariants()


def test_a_failed_step_keeps_the_cached_blocks_its_requests_did_not_hold() -> None:
    scheduler = make_scheduler(num_blocks=64)
    engine = Engine(scheduler, FlakyExecutor(lambda step_id: step_id == 2))
    engine.add_request(make_request("first", 64, max_tokens=1))
    _run(engine, {})  # steps 0 and 1: computed, finished, its blocks free but cached
    engine.add_request(make_request("other", 32, max_tokens=4, base=500))
    with pytest.raises(StepFailed) as info:
        engine.step()
    assert info.value.req_ids == ("other",)
    engine.add_request(make_request("again", 64, max_tokens=1))
    step = engine.step()
    assert step.scheduled.new_reqs == (("again", 48),)  # three full blocks of "first"
    _run(engine, {})
    assert scheduler.cache.num_free_blocks == scheduler.cache.layout.num_blocks - 1


def test_missing_token_fails_only_that_request() -> None:
    inner = fake_executor()

    class Forgetful:
        def execute(self, plan: StepPlan) -> StepResult:
            result = inner.execute(plan)
            kept = {r: t for r, t in result.sampled_token_ids.items() if r != "mute"}
            return StepResult(result.step_id, kept, result.duration_s)

    scheduler = make_scheduler(num_blocks=64)
    engine = Engine(scheduler, Forgetful())
    engine.add_request(make_request("mute", 8, max_tokens=4))
    engine.add_request(make_request("fine", 8, max_tokens=4, base=50))
    step = engine.step()
    assert [f.req_id for f in step.failed] == ["mute"]
    assert "no token" in step.failed[0].reason
    assert [o.req_id for o in step.outputs] == ["fine"]
    outputs: dict[str, list[int]] = {"fine": list(step.outputs[0].new_token_ids)}
    assert _run(engine, outputs) == []
    assert outputs["fine"] == [7, 8, 9, 10]
    scheduler.cache.check_invariants()
    assert scheduler.cache.num_free_blocks == scheduler.cache.layout.num_blocks - 1


def test_token_id_outside_the_vocabulary_fails_only_that_request() -> None:
    executor = FakeExecutor(lambda req_id, t: 5_000 if req_id == "wild" and t == 1 else 3)
    scheduler = make_scheduler(num_blocks=64)
    engine = Engine(scheduler, executor, vocab_size=100)
    engine.add_request(make_request("wild", 8, max_tokens=4))
    engine.add_request(make_request("tame", 8, max_tokens=4, base=50))
    first = engine.step()
    assert not first.failed
    second = engine.step()
    assert [f.req_id for f in second.failed] == ["wild"]
    assert "5000" in second.failed[0].reason and "[0, 100)" in second.failed[0].reason
    assert "wild" not in scheduler.requests
    outputs: dict[str, list[int]] = {}
    _run(engine, outputs)
    assert len(outputs["tame"]) == 2  # the last two of its four tokens
    scheduler.cache.check_invariants()
