"""The one assembly path (`hybridserve.engine.assembly`), the engine's read-only queries, and
the step result's read-only mappings."""

from __future__ import annotations

import itertools

import pytest

from hybridserve.core.config import SchedulerConfig, SpeculativeConfig
from hybridserve.core.plan import StepPlan, StepResult
from hybridserve.engine.assembly import CpuMeter, EngineConfig, build_engine
from hybridserve.executor.fake import FakeExecutor
from hybridserve.kvcache import CacheLayout, FullAttentionSpec, Retention
from hybridserve.kvcache.spec import MambaSpec
from tests.conftest import make_request

GROUPS = (FullAttentionSpec(block_size=16), MambaSpec(block_size=16))


def _config(scheduler: SchedulerConfig | None = None) -> EngineConfig:
    layout = CacheLayout(groups=GROUPS, num_blocks=512)
    return EngineConfig(layout=layout, scheduler=scheduler or SchedulerConfig())


def _fake(layout: CacheLayout) -> FakeExecutor:
    return FakeExecutor(lambda req_id, t: 7 + t)


def test_build_engine_wires_the_given_values_into_one_layout() -> None:
    seen: list[CacheLayout] = []

    def executor(layout: CacheLayout) -> FakeExecutor:
        seen.append(layout)
        return _fake(layout)

    layout = CacheLayout(
        groups=GROUPS,
        num_blocks=512,
        retention=Retention.parse("dense"),
        speculative=SpeculativeConfig.from_name("ngram", 2),
        max_in_flight_tokens=1024,
    )
    config = EngineConfig(
        layout=layout,
        scheduler=SchedulerConfig(max_num_seqs=3),
        enable_caching=False,
        vocab_size=100,
    )
    parts = build_engine(config, executor)
    assert seen == [parts.layout]  # the executor is built once, over the engine's own layout
    assert parts.cache.layout is parts.layout and parts.scheduler.cache is parts.cache
    assert parts.engine.scheduler is parts.scheduler
    assert parts.layout.retention.kind.value == "dense"
    assert parts.layout.max_in_flight_tokens == 1024
    assert parts.scheduler.num_lookahead_tokens == 2
    assert parts.scheduler.config.max_num_seqs == 3
    assert parts.engine.vocab_size == 100
    assert not parts.cache.enable_caching


def test_cpu_meter_charges_schedule_and_update_time_to_the_next_step() -> None:
    ticks = itertools.count()
    meter = CpuMeter(lambda: float(next(ticks)))
    parts = build_engine(_config(), _fake, scheduler_factory=meter.scheduler)
    parts.engine.add_request(make_request("a", 40))
    parts.engine.step()
    # Each of schedule() and update() read the clock twice, one tick apart.
    assert meter.take_s() == 2.0
    assert meter.take_s() == 0.0


def test_engine_step_lists_first_admissions_with_their_arrival_and_prompt() -> None:
    parts = build_engine(_config(), _fake)
    engine = parts.engine
    # "b" finishes in the step that admits it: it is still reported as admitted.
    engine.add_request(make_request("a", 40, arrival=1.5))
    engine.add_request(make_request("b", 8, max_tokens=1, arrival=2.0))
    first = engine.step(3.0)
    assert [(a.req_id, a.arrival_time, a.num_prompt_tokens) for a in first.admitted] == [
        ("a", 1.5, 40),
        ("b", 2.0, 8),
    ]
    assert not engine.has_request("b") and engine.has_request("a")
    assert engine.request_ids() == ("a",)
    assert engine.step(4.0).admitted == ()  # a running request is not admitted again


def test_engine_lists_requests_that_have_not_started() -> None:
    parts = build_engine(_config(SchedulerConfig(max_num_seqs=1)), _fake)
    engine = parts.engine
    engine.add_request(make_request("a", 40))
    engine.add_request(make_request("b", 40))
    engine.step()
    assert engine.unstarted_request_ids() == ("b",)
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    assert {name for name, _, _ in engine.control_samples()} >= {
        "hybridserve:scheduler_governed_prefill_tokens_total"
    }


def test_step_result_mappings_cannot_be_changed_by_its_readers_or_its_maker() -> None:
    sampled = {"a": (1, 2)}
    result = StepResult(0, sampled, 0.0, {"a": (3,)})
    sampled["a"] = (9,)  # the executor's own dict: the result kept a copy
    assert result.sampled_token_ids == {"a": (1, 2)}
    with pytest.raises(TypeError):
        result.sampled_token_ids["b"] = (1,)  # type: ignore[index]
    with pytest.raises(TypeError):
        result.draft_token_ids["a"] = (4,)  # type: ignore[index]
    assert dict(result.logprobs) == {} and dict(result.prompt_logprobs) == {}
    plan_free = FakeExecutor(lambda req_id, t: 0).execute(StepPlan(1, ()))
    with pytest.raises(TypeError):
        plan_free.sampled_token_ids["x"] = (0,)  # type: ignore[index]


def test_step_result_survives_pickling_with_its_mappings_still_read_only() -> None:
    import pickle

    result = pickle.loads(pickle.dumps(StepResult(3, {"a": (1,)}, 0.5, {"a": (2,)})))
    assert result.sampled_token_ids == {"a": (1,)} and result.draft_token_ids == {"a": (2,)}
    with pytest.raises(TypeError):
        result.sampled_token_ids.update({"b": (1,)})  # type: ignore[attr-defined]
