"""The adaptive budget's context weight: a prefill token at context s takes 1 + s / S0 of the
budget, S0 fitted from the steps' times (scheduler/adaptive.py ContextWeight)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.core.config import SchedulerConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import StepResult
from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine.settings import preset
from hybridserve.scheduler.adaptive import (
    CONTEXT_MIN_STEPS,
    MIN_CONTEXT_TOKENS,
    ContextWeight,
    prefill_work,
    tokens_within,
)
from hybridserve.scheduler.controls import PrefillController
from tests.conftest import make_request, make_scheduler


def _pairs(n: int, start: int) -> int:
    return n * start + n * (n + 1) // 2


def _feed(weight: ContextWeight, steps: int, *, per_pair_s: float, seed: int = 0) -> None:
    """Steps of 20 ms + 0.1 ms a decode + 2 ns a decode's context token + 20 us a prefill
    token + `per_pair_s` a prefill pair, one in two carrying a chunk at a random context."""
    rng = random.Random(seed)
    for step in range(steps):
        decode = rng.randint(1, 64)
        decode_kv = decode * rng.randint(1_000, 60_000)
        n, start = (0, 0)
        if step % 2:
            n, start = rng.choice((544, 1_088, 2_176)), rng.randint(0, 100_000)
        pairs = _pairs(n, start) if n else 0
        duration = 0.020 + 1e-4 * decode + 2e-9 * decode_kv + 20e-6 * n + per_pair_s * pairs
        weight.learn(
            decode=decode, decode_kv=decode_kv, prefill=n, prefill_pairs=pairs, duration_s=duration
        )


def test_the_fit_finds_the_context_where_a_tokens_attention_costs_what_the_rest_does() -> None:
    weight = ContextWeight()
    _feed(weight, 400, per_pair_s=2e-10)  # S0 = 20 us / 0.2 ns = 100,000 tokens
    s0 = weight.context_tokens()
    assert s0 == pytest.approx(100_000, rel=0.01)
    # 1,000 tokens after 100,000 cost what 2,005 fresh ones do: each pair is 1/S0 of a token.
    assert prefill_work(1_000, 100_000, s0) == pytest.approx(2_005, rel=0.01)


def test_s0_is_unknown_until_enough_steps_carried_prefill() -> None:
    weight = ContextWeight()
    _feed(weight, 2 * CONTEXT_MIN_STEPS - 2, per_pair_s=2e-10)  # one prefill step short
    assert weight.context_tokens() == 0.0
    assert prefill_work(1_000, 100_000, 0.0) == 1_000  # unknown: the budget counts tokens
    assert tokens_within(1_000.7, 100_000, 0.0) == 1_000
    _feed(weight, 2, per_pair_s=2e-10, seed=1)
    assert weight.context_tokens() > 0


def test_where_attention_costs_nothing_the_weight_stays_one_and_s0_has_a_floor() -> None:
    free = ContextWeight()
    _feed(free, 400, per_pair_s=0.0)
    assert prefill_work(1_000, 100_000, free.context_tokens()) < 1_010
    costly = ContextWeight()  # attention so dear that S0 would be 100 tokens
    _feed(costly, 400, per_pair_s=2e-7)
    assert costly.context_tokens() == MIN_CONTEXT_TOKENS


def _controller(s0: float) -> PrefillController:
    config = preset("hybridserve", quantum=64, max_model_len=131_072).scheduler
    controller = PrefillController(config, quantum=64)
    assert controller.context is not None
    controller.context._s0 = s0  # a fitted S0, refitted only after CONTEXT_REFIT_STEPS steps
    controller.context.prefill_steps = CONTEXT_MIN_STEPS
    return controller


@settings(max_examples=300, deadline=None)
@given(
    work=st.floats(min_value=0, max_value=1e6),
    start=st.integers(0, 300_000),
    s0=st.sampled_from([0.0, 1_024.0, 15_000.0, 200_000.0]),
)
def test_tokens_within_is_the_largest_chunk_whose_work_fits(
    work: float, start: int, s0: float
) -> None:
    n = tokens_within(work, start, s0)
    assert n >= 0 and prefill_work(n, start, s0) <= work
    assert prefill_work(n + 1, start, s0) > work


@settings(max_examples=200, deadline=None)
@given(
    budget_quanta=st.integers(min_value=4, max_value=128),
    partials=st.lists(
        st.tuples(st.integers(0, 200_000), st.integers(1, 20_000)), min_size=1, max_size=5
    ),
    s0=st.floats(min_value=1_024, max_value=200_000),
)
def test_weighted_grants_stay_within_the_budget_and_the_first_always_gets_the_floor(
    budget_quanta: int, partials: list[tuple[int, int]], s0: float
) -> None:
    controller = _controller(s0)
    assert controller.adaptive is not None
    q, floor = 64, controller.adaptive.floor
    budget = budget_quanta * q
    requests = []
    for i, (start, remaining) in enumerate(partials):
        request = make_request(f"r{i}", start + remaining)
        request.num_computed_tokens = start
        requests.append(request)
    grants, waiter = controller._in_order(budget, requests, s0)
    unweighted, _ = controller._in_order(budget, requests, 0.0)
    spent = 0
    for i, request in enumerate(requests):
        grant, (start, remaining) = grants[request.req_id], partials[i]
        assert 0 <= grant <= remaining
        assert grant == remaining or grant % q == 0  # whole quanta unless it completes
        if i == 0:
            assert grant >= min(floor, remaining)  # however long its context
            assert grant <= unweighted[request.req_id]  # never more than the token budget's
            if grant > floor:
                assert prefill_work(grant, start, s0) <= budget
        spent += math.ceil(prefill_work(grant, start, s0))
    assert 0 <= waiter <= max(budget - spent, 0) and waiter % q == 0


def test_a_long_contexts_chunk_is_smaller_by_its_pairs() -> None:
    controller = _controller(20_000.0)
    short, long = make_request("short", 30_000), make_request("long", 130_000)
    long.num_computed_tokens = 100_000
    # Fresh: n + n (n + 1) / 40,000 <= 6,144 gives 5,411 tokens, 5,376 in quanta of 64.
    assert controller._in_order(6_144, [short], 20_000.0)[0] == {"short": 5_376}
    # After 100,000: n (1 + 100,000.5 / 20,000) + n^2 / 40,000 <= 6,144 gives 1,019: 960.
    assert controller._in_order(6_144, [long], 20_000.0)[0] == {"long": 960}


def test_it_is_in_the_shipped_preset_only_and_needs_the_adaptive_budget_alone() -> None:
    assert not SchedulerConfig().adaptive_budget_context_weight
    shipped = preset("hybridserve", quantum=544, max_model_len=131_072).scheduler
    assert shipped.adaptive_budget_context_weight
    for name in ("baseline", "legacy", "decode-first", "fixed-budget"):
        config = preset(name, quantum=544, max_model_len=131_072).scheduler
        assert not config.adaptive_budget_context_weight
        assert PrefillController(config, quantum=544).context is None
    with pytest.raises(ConfigError, match="adaptive_budget_context_weight"):
        SchedulerConfig(adaptive_budget_context_weight=True)
    # Beside a time target (which shares the budget out its own way) it turns itself off and
    # says so once.
    scheduler = make_scheduler(
        adaptive_budget_context_weight=True, adaptive_budget_itl_ms=60.0, target_mixed_step_ms=60.0
    )
    assert scheduler.controls.context is None
    assert scheduler.notices == [
        "adaptive_budget_context_weight is off: a mixed-prefill cap or target_mixed_step_ms "
        "shares the prefill budget out"
    ]
    assert (
        make_scheduler(adaptive_budget_context_weight=True, adaptive_budget_itl_ms=60.0).notices
        == []
    )


def _mixed_steps(weighted: bool) -> list[tuple[int, int, float]]:
    """Two decodes beside 60 one-token turns of 2,000 new tokens each, every other one after a
    cached 30,000-token prefix, on steps of 20 ms + 5 us a prefill token + 1 ns a prefill
    (query, key) pair (S0 = 5,000: a chunk after the prefix costs 7x a fresh one a token), under
    a 60 ms aim: (longest prefill start, prefill tokens, duration) of each mixed step."""
    scheduler = make_scheduler(
        adaptive_budget_itl_ms=60.0,
        adaptive_budget_context_weight=weighted,
        max_num_batched_tokens=4096,
    )
    prefix = tuple(range(100_000, 130_000))
    scheduler.add_request(make_request("a", 8, max_tokens=5_000))
    scheduler.add_request(make_request("b", 8, max_tokens=5_000, base=100))
    scheduler.add_request(_turn("prefix", prefix, arrival=0.001))
    for i in range(60):
        new = tuple(range(200_000 + 3_000 * i, 202_000 + 3_000 * i))
        scheduler.add_request(_turn(f"t{i}", (prefix if i % 2 else ()) + new, 0.01 + i * 1e-4))
    steps, now = [], 0.0
    for _ in range(400):
        out = scheduler.schedule(now)
        prefill = [c for c in out.plan.chunks if c.num_tokens > 1]
        pairs = sum(_pairs(c.num_tokens, c.start) for c in prefill)
        duration = 0.020 + 5e-6 * out.num_prefill_tokens + 1e-9 * pairs
        sampled = {c.req_id: (7,) for c in out.plan.chunks if c.sample}
        scheduler.update(out, StepResult(out.plan.step_id, sampled, duration))
        if prefill and out.num_decode_tokens:
            steps.append((max(c.start for c in prefill), out.num_prefill_tokens, duration))
        now += duration
    return steps


def _turn(req_id: str, tokens: tuple[int, ...], arrival: float) -> Request:
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    return Request(req_id=req_id, prompt_token_ids=tokens, sampling=sampling, arrival_time=arrival)


def test_in_the_scheduler_chunks_after_a_long_prefix_shrink_and_mixed_steps_keep_the_aim() -> None:
    weighted, plain = _mixed_steps(True), _mixed_steps(False)
    # Once S0 is fitted (after 32 steps that carried prefill), every mixed step keeps the aim
    # within 10%, whether it carries a chunk after the prefix, a fresh one, or both ...
    late = [d for *_, d in weighted[40:-1]]  # the last is the end of the queue
    assert len(late) >= 20 and min(late) > 0.054 and max(late) < 0.066
    # ... where the token budget swings: it learns the size of a fresh chunk and runs the next
    # chunk after the prefix far past the aim, then learns that one's and runs short.
    swings = [d for *_, d in plain[40:-1]]
    assert sum(1 for d in swings if d > 0.066) >= 10 and max(swings) > 0.075
    assert min(swings) < 0.035


def test_a_steps_output_carries_what_the_fit_reads() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=1_000)
    scheduler.add_request(make_request("a", 100, max_tokens=50))
    first = scheduler.schedule(0.0)
    scheduler.update(first, StepResult(first.plan.step_id, {"a": (7,)}, 0.01))
    scheduler.add_request(make_request("long", 5_000, base=1_000))
    for now in (0.01, 0.02):  # the second step continues "long" from 999
        out = scheduler.schedule(now)
        scheduler.update(out, StepResult(out.plan.step_id, {"a": (7,)}, 0.01))
    # "a" decodes position 101 (it attends 102 tokens); "long" prefills 999 tokens from 999.
    assert out.num_decode_tokens == 1 and out.decode_kv_tokens == 102
    assert out.num_prefill_tokens == 999 and out.max_prefill_start == 999
    assert out.prefill_pairs == 999 * 999 + 999 * 1_000 // 2


def test_under_the_context_weight_the_budget_starts_at_vllms_budget_with_room_above() -> None:
    config = preset("hybridserve", quantum=64, max_model_len=131_072).scheduler
    controller = PrefillController(config, quantum=64)
    assert controller.adaptive is not None
    assert controller.adaptive.tokens() == config.max_num_batched_tokens
    assert controller.adaptive.ceiling == 32 * config.max_num_batched_tokens
