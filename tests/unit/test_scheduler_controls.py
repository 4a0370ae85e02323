"""Prefill/decode controls (SPEC.md 5.2) and the adaptive time budget (5.3)."""

from __future__ import annotations

import math

import pytest

from hybridserve.core.config import SchedulerConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.request import Request, RequestStatus, SamplingParams
from hybridserve.engine import Engine
from hybridserve.scheduler.controls import PrefillController, is_decode
from hybridserve.scheduler.step_model import StepTimeModel
from tests.conftest import fake_executor, make_request, make_scheduler


def running_request(req_id: str, prompt: int, computed: int, *, arrival: float = 0.0) -> Request:
    request = Request(
        req_id=req_id,
        prompt_token_ids=tuple(range(prompt)),
        sampling=SamplingParams(max_tokens=100),
        arrival_time=arrival,
    )
    request.transition(RequestStatus.RUNNING)
    request.num_computed_tokens = computed
    if computed >= prompt:
        request.append_output_tokens([1])  # a decode: one sampled token not yet computed
    return request


def controller(quantum: int = 1, **config: object) -> PrefillController:
    return PrefillController(SchedulerConfig(**config), quantum=quantum)  # type: ignore[arg-type]


def test_rotation_gives_each_partial_an_equal_share_over_three_steps() -> None:
    ctl = controller(256, max_num_prefill_tokens_per_step=2048)
    decode = running_request("d", 10, 10)
    partials = [running_request(name, 50_000, 0) for name in "ABC"]
    totals = dict.fromkeys("ABC", 0)
    seen = []
    for _ in range(3):
        decision = ctl.decide_and_commit(
            now=0.0,
            running=[decode, *partials],
            waiting=[],
            token_budget=8192,
            seq_slot_free=True,
        )
        assert decision.grants is not None
        seen.append(decision.grants)
        for name, grant in decision.grants.items():
            totals[name] += grant
    assert seen == [
        {"A": 768, "B": 768, "C": 512},
        {"C": 768, "A": 768, "B": 512},
        {"B": 768, "C": 768, "A": 512},
    ]
    assert totals == dict.fromkeys("ABC", 2048)


def test_rotation_remainder_moves_on_like_the_reference_test() -> None:
    ctl = controller(1, max_num_prefill_tokens_per_step=8)
    decode = running_request("d", 10, 10)
    partials = [running_request(name, 500, 0) for name in "abc"]
    first = ctl.decide_and_commit(
        now=0, running=[decode, *partials], waiting=[], token_budget=99, seq_slot_free=False
    )
    assert first.grants == {"a": 3, "b": 3, "c": 2}
    ctl.cap = 2
    second = ctl.decide_and_commit(
        now=0, running=[decode, *partials], waiting=[], token_budget=99, seq_slot_free=False
    )
    assert second.grants == {"c": 1, "a": 1, "b": 0}


def test_no_eligible_decode_keeps_the_full_budget() -> None:
    ctl = controller(1, max_num_prefill_tokens_per_step=64)
    decision = ctl.decide_and_commit(
        now=0,
        running=[running_request("p", 5000, 0)],
        waiting=[],
        token_budget=8192,
        seq_slot_free=True,
    )
    assert decision.grants is None and decision.allow_prefill and decision.waiter_tokens is None


def test_head_waiter_gets_one_reserved_quantum_when_slots_are_free() -> None:
    ctl = controller(256, max_num_prefill_tokens_per_step=1024)
    decode = running_request("d", 10, 10)
    waiter = make_request("w", 4000)
    decision = ctl.decide_and_commit(
        now=0,
        running=[decode, running_request("p", 9000, 0)],
        waiting=[waiter],
        token_budget=8192,
        seq_slot_free=True,
    )
    assert decision.grants == {"p": 768} and decision.waiter_tokens == 256


def test_decode_burst_holds_prefill_for_d_steps_then_releases() -> None:
    ctl = controller(1, max_num_prefill_tokens_per_step=512, decode_prefill_min_decode_steps=3)
    decode = running_request("d", 10, 10)
    waiter = make_request("w", 4000, arrival=0.0)
    allowed = []
    for step in range(8):
        decision = ctl.decide_and_commit(
            now=step * 0.04,
            running=[decode],
            waiting=[waiter],
            token_budget=8192,
            seq_slot_free=True,
        )
        allowed.append(decision.allow_prefill)
        ctl.observe(decision, prefill_tokens=256 if decision.allow_prefill else 0, partials_after=1)
    assert allowed == [False, False, False, True, False, False, False, True]
    assert ctl.stats.decode_only_steps_while_pending == 6


def test_oldest_waiter_deadline_bypasses_the_burst() -> None:
    ctl = controller(
        1,
        max_num_prefill_tokens_per_step=512,
        decode_prefill_min_decode_steps=3,
        decode_prefill_max_wait_ms=500,
    )
    decode = running_request("d", 10, 10)
    decisions = []
    for step, now in enumerate((0.0, 0.04, 0.5, 0.54)):
        waiter = make_request(f"w{step}", 4000, arrival=0.0 if step < 3 else 0.5)
        decision = ctl.decide_and_commit(
            now=now, running=[decode], waiting=[waiter], token_budget=8192, seq_slot_free=True
        )
        decisions.append((decision.allow_prefill, decision.bypass))
        ctl.observe(decision, prefill_tokens=256 if decision.allow_prefill else 0, partials_after=0)
    assert decisions[:2] == [(False, False), (False, False)]
    assert decisions[2] == (True, True) and ctl.stats.deadline_bypasses == 1
    assert decisions[3] == (False, False)  # the next waiter is young: the burst resumes


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_prefill_tokens_per_step": 300}, "max_num_prefill_tokens_per_step"),
    ],
)
def test_cap_must_be_a_multiple_of_the_quantum(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_scheduler(block_size=256, mamba=True, **kwargs)
    assert info.value.field == f"scheduler.{field}"


def run_engine(scheduler, requests, *, steps: int = 10_000):  # type: ignore[no-untyped-def]
    engine = Engine(scheduler, fake_executor())
    for request in requests:
        engine.add_request(request)
    history = []
    for index in range(steps):
        if not engine.has_requests():
            break
        done = engine.step(float(index) * 0.04)
        history.append(done)
        scheduler.cache.check_invariants()
    assert not engine.has_requests(), "requests left unfinished"
    return history


def test_mixed_steps_carry_at_most_the_cap_and_decodes_always_run() -> None:
    scheduler = make_scheduler(max_num_prefill_tokens_per_step=512)
    requests = [make_request("short", 8, max_tokens=40)]
    requests += [
        make_request(f"long{i}", 3000, max_tokens=3, base=10_000 * (i + 1)) for i in range(3)
    ]
    history = run_engine(scheduler, requests)
    for done in history:
        out = done.scheduled
        if out.num_decode_tokens and out.num_prefill_tokens:
            assert out.num_prefill_tokens <= 512
    assert scheduler.controls.stats.governed_prefill_tokens > 0


def test_partial_prefill_bound_keeps_one_prompt_in_flight() -> None:
    scheduler = make_scheduler(max_num_partial_prefills=1, max_num_batched_tokens=1024)
    requests = [make_request(f"r{i}", 3000, max_tokens=2, base=10_000 * i) for i in range(3)]
    engine = Engine(scheduler, fake_executor())
    for request in requests:
        engine.add_request(request)
    overlapped = False
    while engine.has_requests():
        done = engine.step()
        partials = [r for r in scheduler.running if not is_decode(r)]
        assert len(partials) <= 1
        overlapped |= len([n for _, n in done.scheduled.num_scheduled_tokens if n > 1]) > 1
    assert overlapped  # a finishing prompt and the next one shared steps: the bound is on
    # what is left partial, not on what runs


def test_adaptive_grant_grows_with_slack_and_is_one_quantum_without_it() -> None:
    model = StepTimeModel(seed_coefficients=(0.010, 0.0001, 0.00002, 0.0))
    ctl = PrefillController(
        SchedulerConfig(target_mixed_step_ms=40.0), quantum=16, step_model=model
    )
    partial = running_request("p", 90_000, 0)
    grants = []
    for num_decodes in (200, 100, 50, 10):
        decodes = [running_request(f"d{i}", 10, 10) for i in range(num_decodes)]
        decision = ctl.decide_and_commit(
            now=0,
            running=[*decodes, partial],
            waiting=[],
            token_budget=100_000,
            seq_slot_free=False,
        )
        assert decision.grants is not None
        grants.append(decision.grants["p"])
    assert grants == sorted(grants) and grants[-1] > grants[0]
    # predicted: 10 ms + 0.1 ms/decode + 0.02 ms/prefill token -> (40-10-1)/0.02 = 1450 -> 1440
    assert grants[-1] == 1440
    slow = StepTimeModel(seed_coefficients=(0.050, 0.0, 0.00002, 0.0))
    ctl_slow = PrefillController(
        SchedulerConfig(target_mixed_step_ms=40.0), quantum=16, step_model=slow
    )
    decision = ctl_slow.decide_and_commit(
        now=0,
        running=[running_request("d", 10, 10), partial],
        waiting=[],
        token_budget=100_000,
        seq_slot_free=False,
    )
    assert decision.grants == {"p": 16}  # no slack: one quantum, so prefill never starves


def test_exact_model_keeps_mixed_steps_within_target_plus_one_quantum() -> None:
    coefficients = (0.005, 0.0002, 0.00004, 0.0)
    model = StepTimeModel(seed_coefficients=coefficients)
    scheduler = make_scheduler(target_mixed_step_ms=30.0)
    scheduler.controls.model = model
    requests = [make_request(f"d{i}", 8, max_tokens=60, base=1000 * i) for i in range(20)]
    requests += [make_request("long", 6000, max_tokens=2, base=900_000)]
    history = run_engine(scheduler, requests)
    quantum_cost = coefficients[2] * 1
    for done in history:
        out = done.scheduled
        if out.num_decode_tokens and out.num_prefill_tokens:
            actual = model.predict(model.features(out.num_decode_tokens, out.num_prefill_tokens, 0))
            assert actual <= 0.030 + quantum_cost + 1e-9


def test_step_model_learns_linear_costs_and_flags_large_errors() -> None:
    model = StepTimeModel(forgetting=1.0)
    truth = (0.004, 0.0003, 0.00005, 0.0000001)
    for i in range(200):
        x = model.features(10 + i % 37, (i * 97) % 2048, (i * 1013) % 50_000)
        model.update(x, sum(c * v for c, v in zip(truth, x, strict=True)))
    for got, want in zip(model.theta, truth, strict=True):
        assert got == pytest.approx(want, rel=0.05, abs=1e-6)
    assert model.recent_error < 0.01
    for _ in range(8):
        model.update(model.features(10, 0, 0), 1.0)
    assert model.recent_error > 0.25


def test_adaptive_grant_falls_back_to_the_cap_when_predictions_are_poor() -> None:
    model = StepTimeModel(seed_coefficients=(0.001, 0.0, 0.0, 0.0))
    for i in range(8):  # the same step shape takes 1 ms, then 100 ms: nothing fits
        model.update(model.features(1, 0, 0), 0.1 if i % 2 else 0.001)
    ctl = PrefillController(
        SchedulerConfig(target_mixed_step_ms=20.0, max_num_prefill_tokens_per_step=256),
        quantum=1,
        step_model=model,
    )
    decision = ctl.decide_and_commit(
        now=0,
        running=[running_request("d", 10, 10), running_request("p", 9000, 0)],
        waiting=[],
        token_budget=8192,
        seq_slot_free=False,
    )
    assert decision.grants == {"p": 256} and ctl.stats.adaptive_fallbacks == 1


def test_every_request_finishes_under_every_control_setting() -> None:
    settings = [
        {},
        {"max_num_prefill_tokens_per_step": 256},
        {"max_num_prefill_tokens_per_step": 256, "decode_prefill_min_decode_steps": 2},
        {
            "max_num_prefill_tokens_per_step": 256,
            "decode_prefill_min_decode_steps": 4,
            "decode_prefill_max_wait_ms": 100.0,
            "max_num_partial_prefills": 1,
        },
        {"target_mixed_step_ms": 5.0},
    ]
    for setting in settings:
        scheduler = make_scheduler(num_blocks=600, **setting)
        requests = [
            make_request(f"r{i}", 500 + 97 * i, max_tokens=5 + i, base=7 * i) for i in range(12)
        ]
        finished = {
            o.req_id for done in run_engine(scheduler, requests) for o in done.outputs if o.finished
        }
        assert finished == {r.req_id for r in requests}, setting


def test_scheduler_metrics_report_the_control_counters_by_name() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=512,
        max_num_prefill_tokens_per_step=256,
        decode_prefill_min_decode_steps=2,
    )
    requests = [make_request("short", 8, max_tokens=30)]
    requests += [make_request("long", 2000, max_tokens=2, base=50_000)]
    run_engine(scheduler, requests)
    snapshot = scheduler.metrics_snapshot()
    assert snapshot["hybridserve:scheduler_governed_prefill_tokens_total"] > 0
    assert snapshot["hybridserve:scheduler_decode_only_steps_while_prefill_pending_total"] > 0
    assert snapshot["hybridserve:num_requests_running"] == 0
    assert all(name.startswith("hybridserve:") for name in snapshot)


def test_step_model_stays_finite_through_long_unexcited_stretches() -> None:
    """Thousands of decode-only steps never excite the prefill feature; without a bound on the
    covariance its variance overflows and the adaptive grant became NaN."""
    model = StepTimeModel(seed_coefficients=(0.010, 0.0001, 0.00002, 0.0))
    for step in range(40_000):
        model.update(model.features(40, 0, 40 * 30_000), 0.012 + 1e-9 * (step % 7))
    assert all(math.isfinite(c) for c in model.theta)
    model.update(model.features(40, 4_352, 40 * 30_000), 0.080)  # then a prefill arrives
    prediction = model.predict(model.features(40, 4_352, 40 * 30_000))
    assert math.isfinite(prediction) and 0.0 < prediction < 1.0
