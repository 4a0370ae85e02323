"""The adaptive prefill budget (hybridserve/scheduler/adaptive.py): it converges on a constant
load, stays within [floor, max_num_batched_tokens] in whole quanta, opens its queue valve when
prefill waits too long, and is off unless asked for (so `baseline` stays vLLM's schedule)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.core.config import SchedulerConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import StepResult
from hybridserve.engine.settings import PRESETS, preset
from hybridserve.scheduler.adaptive import (
    FLOOR_RETRY_STEPS,
    LEVEL_LIMIT,
    PRESSURE_LEVEL_LIMIT,
    AdaptiveBudget,
)
from hybridserve.scheduler.controls import PrefillController
from tests.conftest import make_request, make_scheduler


def budget(quantum: int = 1, **config: object) -> AdaptiveBudget:
    return AdaptiveBudget(SchedulerConfig(**config), quantum=quantum)  # type: ignore[arg-type]


def test_the_budget_converges_to_the_prefill_that_meets_the_target_on_a_constant_load() -> None:
    # A step costs 30 ms plus 25 us per prefill token: 80 ms allows (80 - 30) / 0.025 = 2,000
    # tokens, 1,920 in whole quanta of 64.
    adaptive = budget(64, adaptive_budget_itl_ms=80.0, max_num_batched_tokens=8192)
    seen = []
    for _ in range(40):
        tokens = adaptive.tokens()
        seen.append(tokens)
        adaptive.update(
            duration_s=0.030 + 25e-6 * tokens, prefill_tokens=tokens, budget=tokens, pressure=False
        )
    assert seen[0] == 8192  # it starts at vLLM's budget and learns down
    assert all(1920 - 64 <= t <= 2000 + 64 for t in seen[-10:]), seen
    assert all(t % 64 == 0 for t in seen)


def test_the_budget_grows_back_when_the_load_gets_lighter() -> None:
    adaptive = budget(64, adaptive_budget_itl_ms=80.0, max_num_batched_tokens=8192)
    for cost in (50e-6, 5e-6):  # heavy tokens first, then light ones
        for _ in range(60):
            tokens = adaptive.tokens()
            adaptive.update(
                duration_s=0.030 + cost * tokens,
                prefill_tokens=tokens,
                budget=tokens,
                pressure=False,
            )
        if cost == 50e-6:
            assert adaptive.tokens() <= 1088  # (80 - 30) / 0.05 = 1,000 (+ a quantum)
    assert adaptive.tokens() == 8192  # 30 + 5 us x 8,192 = 71 ms: the whole budget fits


def _mixed_steps_past(adaptive: AdaptiveBudget, steps: int, per_token_s: float) -> list[int]:
    """Mixed steps of 60 ms of decodes plus `per_token_s` a prefill token, each using its whole
    budget; the budgets of those that ran past 1.1 x the 88 ms target."""
    over = []
    for _ in range(steps):
        tokens = adaptive.tokens()
        duration = 0.060 + per_token_s * tokens
        if duration > 1.1 * 0.088:
            over.append(tokens)
        adaptive.update(duration_s=duration, prefill_tokens=tokens, budget=tokens, pressure=False)
    return over


def test_the_budget_does_not_climb_back_into_a_quantum_whose_steps_ran_past_the_aim() -> None:
    # Quanta of 544 tokens (a hybrid model's state block), 24 us a token: 1,088 tokens take
    # 86.1 ms (under the 88 ms target), 1,632 take 99.2 ms (past 1.1 x 88 = 96.8). Growth from
    # 1,088 is at least a quantum: without the memory every other mixed step would be 1,632.
    adaptive = budget(544, adaptive_budget_itl_ms=88.0, max_num_batched_tokens=8192)
    over = _mixed_steps_past(adaptive, 150, 24e-6)
    assert adaptive.tokens() == 1088
    # Learning down from vLLM's budget, then one growth to 1,632, measured and remembered.
    assert over == [8160, 3808, 2176, 1632, 1632]
    # Forgotten LEVEL_MEMORY_STEPS updates after its last step: tried once more, then again.
    assert _mixed_steps_past(adaptive, 100, 24e-6).count(1632) == 1


def test_a_budget_predicted_past_the_aim_stays_closed_and_thinner_decodes_reopen_it() -> None:
    adaptive = budget(64, adaptive_budget_itl_ms=88.0, max_num_batched_tokens=8192)
    adaptive.levels[1280] = (120e-6, 0)  # growing to 1,280 cost 120 us a token
    adaptive.tokens_f = 1024.0
    adaptive.update(duration_s=0.070, prefill_tokens=1024, budget=1024, pressure=False)
    # 88 / 70 > 1.25: 1.25 x 1,024 = 1,280, predicted at 70 + 256 x 0.12 = 100.7 ms (past
    # 1.1 x 88 = 96.8): a quantum under it.
    assert adaptive.tokens() == 1216
    # The decodes thin: 1,024 tokens take 60 ms, 1,280 is predicted at 90.7 ms and is open.
    adaptive.last_binding = None
    adaptive.tokens_f = 1024.0
    adaptive.update(duration_s=0.060, prefill_tokens=1024, budget=1024, pressure=False)
    assert adaptive.tokens() == 1280


def test_under_the_valves_step_time_limit_growth_keeps_the_margin_that_tp_leaves() -> None:
    # The open valve aims at Tp = 88 ms. Quanta of 544 tokens, 60 ms of decodes and 20 us a
    # token: 1,088 tokens take 81.8 ms, 1,632 take 92.6 ms, within 1.1 x Tp (96.8 ms) but past
    # Tp. The 1.1 tolerance would climb back to 1,632 after every step under Tp.
    adaptive = budget(
        544,
        adaptive_budget_itl_ms=75.0,
        adaptive_budget_queue_ms=2000.0,
        adaptive_budget_pressure_itl_ms=88.0,
        max_num_batched_tokens=8192,
    )
    seen = []
    for _ in range(150):
        tokens = adaptive.tokens()
        seen.append(tokens)
        adaptive.update(
            duration_s=0.060 + 20e-6 * tokens, prefill_tokens=tokens, budget=tokens, pressure=True
        )
    assert PRESSURE_LEVEL_LIMIT * 0.088 < 0.060 + 20e-6 * 1632
    assert adaptive.tokens() == 1088
    assert seen[-100:].count(1632) == 0  # measured once on the way, then never again
    # Outside the valve the aim keeps its 1.1 tolerance (tested above): only Tp lost it.
    assert LEVEL_LIMIT > PRESSURE_LEVEL_LIMIT


def test_an_open_valve_grows_past_budgets_that_ran_long() -> None:
    adaptive = budget(544, adaptive_budget_itl_ms=88.0, adaptive_budget_queue_ms=2000.0)
    adaptive.levels[1632] = (1e-3, 0)  # 544 tokens more cost 544 ms
    adaptive.tokens_f = 1088.0
    adaptive.update(duration_s=0.086, prefill_tokens=1088, budget=1088, pressure=True)
    assert adaptive.tokens() == 1632  # the queue trades ITL for time to first token


def test_the_step_time_memory_stays_bounded() -> None:
    adaptive = budget(1, adaptive_budget_itl_ms=88.0, max_num_batched_tokens=20_000)
    for step in range(2_000):
        tokens = 1000 + step  # a new budget every step, each a growth from the one before
        adaptive.update(duration_s=0.080, prefill_tokens=tokens, budget=tokens, pressure=False)
    assert len(adaptive.levels) <= 201


def test_a_budget_that_does_not_bind_does_not_grow() -> None:
    adaptive = budget(1, adaptive_budget_itl_ms=80.0, max_num_batched_tokens=8192)
    adaptive.tokens_f = 1000.0
    adaptive.update(duration_s=0.010, prefill_tokens=100, budget=1000, pressure=False)
    assert adaptive.tokens() == 1000  # fast, but prefill left nothing waiting: no evidence


def test_the_queue_valve_grows_the_budget_to_the_ceiling_whatever_the_step_time() -> None:
    valve = {"adaptive_budget_queue_ms": 2000.0, "max_num_batched_tokens": 4096}
    adaptive = budget(16, adaptive_budget_itl_ms=50.0, **valve)
    adaptive.tokens_f = 256.0
    assert not adaptive.under_pressure(1.9) and adaptive.under_pressure(2.0)
    for _ in range(30):
        tokens = adaptive.tokens()
        adaptive.update(duration_s=0.200, prefill_tokens=tokens, budget=tokens, pressure=True)
    assert adaptive.tokens() == 4096
    adaptive.update(duration_s=0.200, prefill_tokens=4096, budget=4096, pressure=False)
    assert adaptive.tokens() == 2048  # the valve closed: slow steps halve it again


def test_without_a_queue_limit_the_valve_never_opens() -> None:
    adaptive = budget(1, adaptive_budget_itl_ms=50.0)
    assert not adaptive.under_pressure(1e9)


@settings(max_examples=200, deadline=None)
@given(
    quantum=st.sampled_from([1, 16, 64, 544]),
    ceiling=st.integers(min_value=1, max_value=20_000),
    steps=st.lists(
        st.tuples(
            st.floats(min_value=1e-4, max_value=2.0),
            st.floats(min_value=0.0, max_value=1.0),
            st.booleans(),
        ),
        max_size=60,
    ),
)
def test_the_budget_never_leaves_its_bounds_and_is_whole_quanta(
    quantum: int, ceiling: int, steps: list[tuple[float, float, bool]]
) -> None:
    adaptive = budget(
        quantum,
        adaptive_budget_itl_ms=80.0,
        adaptive_budget_queue_ms=1000.0,
        max_num_batched_tokens=ceiling,
    )
    for duration, used, pressure in steps:
        tokens = adaptive.tokens()
        assert 1 <= tokens <= ceiling
        assert tokens == ceiling or tokens % quantum == 0
        adaptive.update(
            duration_s=duration,
            prefill_tokens=int(tokens * used),
            budget=tokens,
            pressure=pressure,
        )
    assert adaptive.tokens() <= ceiling


def test_it_is_off_by_default_and_in_the_vllm_presets() -> None:
    assert SchedulerConfig().adaptive_budget_itl_ms == 0
    assert not PrefillController(SchedulerConfig(), quantum=1).enabled
    for name in ("baseline", "legacy"):
        config = preset(name, quantum=544, max_model_len=131_072).scheduler
        assert config.adaptive_budget_itl_ms == 0 and config.adaptive_budget_queue_ms == 0
        assert not PrefillController(config, quantum=544).enabled
    assert "baseline" in PRESETS


def test_a_queue_limit_without_the_budget_is_refused() -> None:
    with pytest.raises(ConfigError, match="adaptive_budget_queue_ms"):
        SchedulerConfig(adaptive_budget_queue_ms=5000.0)
    with pytest.raises(ConfigError, match="adaptive_budget_itl_ms"):
        SchedulerConfig(adaptive_budget_itl_ms=-1.0)


def _run(
    scheduler_config: dict[str, Any],
    *,
    per_token_s: float,
    base_s: float = 0.020,
    long_at_step: int = 0,
) -> list[tuple[int, int]]:
    """Two decodes beside one long prompt (queued before step `long_at_step`) on a scheduler
    whose steps cost `base_s` (20 ms) plus `per_token_s` per prefill token: (prefill tokens,
    decode tokens) of each step."""
    scheduler = make_scheduler(**scheduler_config)  # type: ignore[arg-type]
    return _run_on(scheduler, per_token_s=per_token_s, base_s=base_s, long_at_step=long_at_step)


def _run_on(
    scheduler: Any, *, per_token_s: float, base_s: float, long_at_step: int
) -> list[tuple[int, int]]:
    scheduler.add_request(make_request("a", 8, max_tokens=400))
    scheduler.add_request(make_request("b", 8, max_tokens=400, base=100))
    shapes, now = [], 0.0
    for step in range(120):
        if step == long_at_step:
            scheduler.add_request(
                make_request("long", 20_000, max_tokens=2, base=10_000, arrival=now + 0.01)
            )
        out = scheduler.schedule(now)
        duration = base_s + per_token_s * out.num_prefill_tokens
        sampled = {c.req_id: (7,) for c in out.plan.chunks if c.sample}
        scheduler.update(out, StepResult(out.plan.step_id, sampled, duration))
        shapes.append((out.num_prefill_tokens, out.num_decode_tokens))
        now += duration
    return shapes


def test_in_the_scheduler_mixed_steps_shrink_to_the_target_and_decodes_always_run() -> None:
    config = {"adaptive_budget_itl_ms": 60.0, "max_num_batched_tokens": 4096}
    shapes = _run(config, per_token_s=20e-6)  # 60 ms allows (60 - 20) / 0.02 = 2,000 tokens
    mixed = [p for p, d in shapes if p and d]
    assert mixed and max(p for p, _ in shapes) <= 4096
    assert mixed[0] > 2000 and all(p <= 2000 + 16 for p in mixed[4:])
    assert all(d >= 2 for _, d in shapes[1:50])  # both decodes run in every step after the first
    baseline = _run({"max_num_batched_tokens": 4096}, per_token_s=20e-6)
    assert max(p for p, d in baseline if d) > 2000  # without it vLLM fills the budget


def test_the_scheduler_snapshot_carries_the_budget_and_the_valve_steps_only_when_it_is_on() -> None:
    on = make_scheduler(adaptive_budget_itl_ms=60.0, max_num_batched_tokens=4096)
    snapshot = on.metrics_snapshot()
    assert snapshot["hybridserve:scheduler_adaptive_prefill_budget_tokens"] == 4096
    assert snapshot["hybridserve:scheduler_queue_pressure_steps_total"] == 0
    off = make_scheduler().metrics_snapshot()
    assert "hybridserve:scheduler_adaptive_prefill_budget_tokens" not in off


def test_the_open_valve_with_a_step_time_limit_converges_on_that_limit_not_the_ceiling() -> None:
    # 30 ms + 25 us per token: 80 ms allows 2,000 tokens, the 100 ms limit 2,800.
    adaptive = budget(
        64,
        adaptive_budget_itl_ms=80.0,
        adaptive_budget_queue_ms=1000.0,
        adaptive_budget_pressure_itl_ms=100.0,
        max_num_batched_tokens=8192,
    )
    for pressure in (False, True):
        for _ in range(60):
            tokens = adaptive.tokens()
            adaptive.update(
                duration_s=0.030 + 25e-6 * tokens,
                prefill_tokens=tokens,
                budget=tokens,
                pressure=pressure,
            )
        if not pressure:
            assert adaptive.tokens() <= 2000 + 64
    assert 2800 - 128 <= adaptive.tokens() <= 2800 + 64  # not 8,192: the limit holds


def test_a_pressure_limit_needs_the_valve_and_at_least_the_target() -> None:
    with pytest.raises(ConfigError, match="adaptive_budget_pressure_itl_ms"):
        SchedulerConfig(adaptive_budget_itl_ms=80.0, adaptive_budget_pressure_itl_ms=95.0)
    with pytest.raises(ConfigError, match="at least adaptive_budget_itl_ms=80"):
        SchedulerConfig(
            adaptive_budget_itl_ms=80.0,
            adaptive_budget_queue_ms=5000.0,
            adaptive_budget_pressure_itl_ms=60.0,
        )


def test_an_open_valve_stays_open_until_the_oldest_wait_falls_under_a_quarter_of_w() -> None:
    adaptive = budget(1, adaptive_budget_itl_ms=80.0, adaptive_budget_queue_ms=4000.0)
    assert not adaptive.under_pressure(3.9)
    adaptive.valve_open = True  # the controller sets it from the plan of each mixed step
    assert adaptive.under_pressure(3.9) and adaptive.under_pressure(1.0)
    assert not adaptive.under_pressure(0.99)


def test_in_the_scheduler_a_budget_at_its_ceiling_is_vllms_step_unfloored() -> None:
    # 20 ms + 5 us per token: 60 ms allows 8,000 tokens, so the budget stays at its ceiling and
    # every step is vLLM's own, token for token (not floored to the 16-token quantum).
    config = {"adaptive_budget_itl_ms": 60.0, "max_num_batched_tokens": 4090, "mamba": True}
    vllm = _run({"max_num_batched_tokens": 4090, "mamba": True}, per_token_s=5e-6)
    assert _run(config, per_token_s=5e-6) == vllm
    scheduler = make_scheduler(**config)  # type: ignore[arg-type]
    scheduler.add_request(make_request("a", 8, max_tokens=400))
    first = scheduler.schedule(0.0)
    scheduler.update(first, StepResult(first.plan.step_id, {"a": (7,)}, 0.03))
    scheduler.add_request(make_request("long", 20_000, max_tokens=2, base=10_000))
    mixed = scheduler.schedule(0.03)
    # The whole room of the step (4,090 less one decode), not floored to the 16-token quantum.
    assert mixed.num_decode_tokens == 1 and mixed.mixed_budget == 4089
    # Slow tokens (100 us each): mixed steps learn down from the ceiling all the same.
    shapes = _run(config, per_token_s=100e-6)
    mixed = [p for p, d in shapes if p and d]
    assert mixed[0] > 4000 and all(p <= 400 + 16 for p in mixed[6:])


def _calm(**extra: object) -> AdaptiveBudget:
    config = {
        "adaptive_budget_itl_ms": 80.0,
        "adaptive_budget_queue_ms": 2000.0,
        "adaptive_budget_calm_itl_ms": 60.0,
        "max_num_batched_tokens": 8192,
    }
    return budget(64, **{**config, **extra})


def test_a_calm_target_rises_in_a_line_from_tc_with_no_wait_to_t_at_half_the_queue_limit() -> None:
    adaptive = _calm()
    assert adaptive.target(0.0) == pytest.approx(0.060)
    assert adaptive.target(0.5) == pytest.approx(0.070)  # a quarter of W: half way
    assert adaptive.target(1.0) == pytest.approx(0.080)
    assert adaptive.target(5.0) == pytest.approx(0.080)  # never past T
    assert budget(1, adaptive_budget_itl_ms=80.0).target(0.0) == pytest.approx(0.080)  # off


@pytest.mark.parametrize(("wait_s", "tokens"), [(0.0, 1200), (0.5, 1600), (3.0, 2000)])
def test_with_a_calm_target_the_budget_converges_to_the_aim_of_the_oldest_wait(
    wait_s: float, tokens: int
) -> None:
    # 30 ms + 25 us per token: 60 ms allows 1,200 tokens, 70 ms 1,600, 80 ms 2,000.
    adaptive = _calm()
    for _ in range(60):
        budget_now = adaptive.tokens()
        adaptive.update(
            duration_s=0.030 + 25e-6 * budget_now,
            prefill_tokens=budget_now,
            budget=budget_now,
            pressure=False,
            oldest_wait_s=wait_s,
        )
    assert tokens - 64 <= adaptive.tokens() <= tokens + 64


def test_a_calm_target_needs_the_valve_and_at_most_the_target() -> None:
    with pytest.raises(ConfigError, match="adaptive_budget_calm_itl_ms"):
        SchedulerConfig(adaptive_budget_itl_ms=80.0, adaptive_budget_calm_itl_ms=60.0)
    with pytest.raises(ConfigError, match="at most adaptive_budget_itl_ms=80"):
        SchedulerConfig(
            adaptive_budget_itl_ms=80.0,
            adaptive_budget_queue_ms=2000.0,
            adaptive_budget_calm_itl_ms=90.0,
        )


def test_in_the_scheduler_a_calm_target_keeps_mixed_steps_shorter_until_prefill_waits() -> None:
    # 20 ms + 20 us per token: T = 60 ms allows 2,000 tokens, Tc = 40 ms 1,000. The long prompt
    # has waited under W/2 = 1 s for its first steps, so they learn towards Tc, and rise as its
    # wait grows.
    base = {"adaptive_budget_itl_ms": 60.0, "max_num_batched_tokens": 4096}
    valve = {**base, "adaptive_budget_queue_ms": 2000.0}
    calm = _run({**valve, "adaptive_budget_calm_itl_ms": 40.0}, per_token_s=20e-6)
    plain = _run(valve, per_token_s=20e-6)
    calm_mixed = [p for p, d in calm if p and d]
    plain_mixed = [p for p, d in plain if p and d]
    assert all(p >= 2000 - 16 for p in plain_mixed[3:6])  # T from the start
    assert all(p <= 1500 for p in calm_mixed[3:6])  # near Tc's 1,000 while the wait is short
    assert calm_mixed[-2] > calm_mixed[4]  # and rising with the wait
    assert all(p <= 2000 + 16 for p in calm_mixed[6:])


def test_decode_only_steps_past_the_target_make_the_budget_stand_aside_at_vllms_budget() -> None:
    adaptive = budget(64, adaptive_budget_itl_ms=75.0, max_num_batched_tokens=8192)
    for _ in range(20):  # mixed steps of 30 ms + 50 us a token learn down to (75 - 30) / 0.05
        tokens = adaptive.tokens()
        adaptive.update(
            duration_s=0.030 + 50e-6 * tokens, prefill_tokens=tokens, budget=tokens, pressure=False
        )
    assert adaptive.tokens() <= 960 and not adaptive.stands_aside
    adaptive.observe_decode_only(0.060)  # under T: nothing changes
    assert not adaptive.stands_aside and adaptive.tokens() <= 960
    for _ in range(3):  # the running average passes 75 ms on the third 90 ms step
        adaptive.observe_decode_only(0.090)
    assert adaptive.stands_aside and adaptive.tokens() == 8192
    # Standing aside, a mixed step of any length moves nothing.
    adaptive.update(duration_s=1.5, prefill_tokens=8192, budget=8192, pressure=False)
    assert adaptive.tokens() == 8192
    adaptive.observe_decode_only(0.070)  # 86 ms on average: still past 0.9 x 75
    assert adaptive.stands_aside
    for _ in range(6):
        adaptive.observe_decode_only(0.040)
    assert not adaptive.stands_aside  # under 67.5 ms: it learns down again from vLLM's budget
    adaptive.update(duration_s=0.150, prefill_tokens=8192, budget=8192, pressure=False)
    assert adaptive.tokens() == 4096


def test_in_the_scheduler_decodes_slower_than_the_target_get_vllms_steps_and_are_counted() -> None:
    # Decodes alone take 90 ms against T = 75: no prefill budget keeps a mixed step under it, so
    # after the decode-only steps before the long prompt every mixed step is vLLM's, token for
    # token.
    config = {"adaptive_budget_itl_ms": 75.0, "max_num_batched_tokens": 4096}
    slow = {"per_token_s": 100e-6, "base_s": 0.090, "long_at_step": 4}
    scheduler = make_scheduler(**config)  # type: ignore[arg-type]
    adaptive_run = _run_on(scheduler, **slow)  # type: ignore[arg-type]
    vllm_run = _run({"max_num_batched_tokens": 4096}, **slow)  # type: ignore[arg-type]
    assert adaptive_run == vllm_run
    snapshot = scheduler.metrics_snapshot()
    assert snapshot["hybridserve:scheduler_adaptive_stand_aside_steps_total"] >= 5
    # The same load with 20 ms decodes: the budget governs (mixed steps far under vLLM's).
    fast = _run(config, per_token_s=100e-6, long_at_step=4)
    assert max(p for p, d in fast[10:] if d) <= 600 < max(p for p, d in vllm_run[4:] if d)


def _floor_steps(adaptive: AdaptiveBudget, steps: int, floor_step_s: float) -> list[int]:
    """Mixed steps each using their whole budget: `floor_step_s` at the floor (256 tokens), 5 ms
    more a token past it; the budget each step had."""
    seen = []
    for _ in range(steps):
        tokens = adaptive.tokens()
        seen.append(tokens)
        duration = floor_step_s + 5e-3 * (tokens - 256)
        adaptive.update(duration_s=duration, prefill_tokens=tokens, budget=tokens, pressure=False)
    return seen


PRESET_AIMS = {
    "adaptive_budget_itl_ms": 75.0,
    "adaptive_budget_queue_ms": 2000.0,
    "adaptive_budget_pressure_itl_ms": 88.0,
}


def test_floor_steps_past_every_aim_make_the_budget_stand_aside_and_try_again_later() -> None:
    # T = 75 ms, Tp = 88 ms; a floor of prefill runs 0.37 s (a CPU prefilling 256 tokens): no
    # budget reaches either aim, so after three floor steps the steps are vLLM's.
    adaptive = budget(64, max_num_batched_tokens=2048, **PRESET_AIMS)
    seen = _floor_steps(adaptive, 8, floor_step_s=0.37)
    assert seen[:4] == [2048, 1024, 512, 256]  # it learns down to its floor
    assert seen[4:7] == [256, 256] + [2048]  # the third floor step makes it stand aside
    assert adaptive.stands_aside and not adaptive.decode_aside
    # Decode-only steps under T change nothing, and vLLM's steps move no budget ...
    adaptive.observe_decode_only(0.030)
    seen = _floor_steps(adaptive, FLOOR_RETRY_STEPS - 3, floor_step_s=0.37)
    assert adaptive.stands_aside and set(seen) == {2048}
    # ... until FLOOR_RETRY_STEPS of them carried prefill: it learns down and tries the floor.
    seen = _floor_steps(adaptive, 8, floor_step_s=0.37)
    assert seen[:5] == [2048, 2048, 1024, 512, 256] and seen[-1] == 2048
    # Floors that come back under Tp keep it governing (at the floor, 80 ms a step).
    adaptive = budget(64, max_num_batched_tokens=2048, **PRESET_AIMS)
    seen = _floor_steps(adaptive, 40, floor_step_s=0.080)
    assert not adaptive.stands_aside and seen[-1] == 256


def test_in_the_scheduler_a_floor_slower_than_the_target_gets_vllms_steps() -> None:
    # 20 ms + 1 ms a prefill token: 256 tokens alone run 0.28 s against T = 75 ms. After the
    # budget learns down to its floor, the long prompt is prefilled in vLLM's 4,096-token steps,
    # not 256 at a time beside the decodes.
    config = {"adaptive_budget_itl_ms": 75.0, "max_num_batched_tokens": 4096}
    scheduler = make_scheduler(**config)  # type: ignore[arg-type]
    shapes = _run_on(scheduler, per_token_s=1e-3, base_s=0.020, long_at_step=4)
    mixed = [p for p, d in shapes if p and d]
    assert mixed[:5] == [4094, 2047, 1023, 511, 256]  # vLLM's room, then learning down
    assert mixed[5:7] == [256, 256] and mixed[7] == 4094  # three floor steps, then vLLM's
    assert len(mixed) < 20  # 20,000 tokens at 256 a step would be 78 mixed steps
    snapshot = scheduler.metrics_snapshot()
    assert snapshot["hybridserve:scheduler_adaptive_stand_aside_steps_total"] >= 3
