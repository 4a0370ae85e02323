"""Property tests of the scheduler's prefill/decode controls (SPEC.md 5.1-5.3, 8 items 13-15).

Every example draws a random trace and drives it through `Engine(scheduler, fake_executor())`,
one `engine.step(now)` per 30 ms. A trace has 1-10 requests with prompts of 1-3000 tokens (some
start with a prefix of one of two shared documents, up to a whole document, so prefix hits and
Mamba junctions occur), 1-40 output tokens, arrivals spread over the first 40 steps and, under
the priority policy, priorities 0-2. A setup draws the layout (full attention, or full attention
plus an align-mode Mamba group; block 16 or 32), a KV pool that is either just large enough for
the largest request (so that running requests preempt each other) or large, the token budget,
`max_num_seqs`, the long-prefill threshold and the controls: Cp a multiple of the quantum q (the
Mamba block size, or 1), Mp 0-3, D 0-4 (with Cp > 0), W 0 or 50-500 ms (with D > 0) and
T 0 or 5-50 ms with a seeded step-time model.

Before each step the driver snapshots what the controller sees (eligible decode, pending prefill,
the waiting queue and its ages); after it, the output and the queues. Each test checks one
behaviour over those records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from hypothesis import event, given, settings
from hypothesis import strategies as st

from hybridserve.core.config import SchedulingPolicy
from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine import Engine
from hybridserve.scheduler import Scheduler, SchedulerOutput
from hybridserve.scheduler.controls import UNLIMITED, ControlStats, is_decode
from hybridserve.scheduler.step_model import StepTimeModel
from tests.conftest import fake_executor, make_request, make_scheduler

DT = 0.03  # seconds between steps
MAX_PROMPT = 3000
MAX_OUTPUT = 40
MAX_ARRIVAL_STEP = 40
MAX_STEPS = 3000  # liveness bound; the longest trace seen in development needs a few hundred
DOC_BASE = 100_000  # token ids of shared document d: DOC_BASE * (d + 1) + position
OWN_BASE = 1_000_000  # token ids of request i's own suffix: OWN_BASE + 10_000 * i + position
STEP_MODEL_SEED = (0.004, 0.0002, 0.00002, 0.0)  # seconds: base, per decode, per prefill, per kv

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None)


# ----- traces ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrawnRequest:
    index: int
    length: int  # prompt tokens
    doc: int | None  # the shared document the prompt starts with, if any
    shared: int  # tokens taken from it
    max_tokens: int
    arrival_step: int
    priority: int

    @property
    def req_id(self) -> str:
        return f"r{self.index}"

    @property
    def token_ids(self) -> tuple[int, ...]:
        prefix = (
            [] if self.doc is None else [DOC_BASE * (self.doc + 1) + t for t in range(self.shared)]
        )
        own = [OWN_BASE + 10_000 * self.index + t for t in range(self.length - self.shared)]
        return (*prefix, *own)

    def build(self, arrival_time: float) -> Request:
        return Request(
            req_id=self.req_id,
            prompt_token_ids=self.token_ids,
            sampling=SamplingParams(max_tokens=self.max_tokens, ignore_eos=True),
            arrival_time=arrival_time,
            priority=self.priority,
        )


@dataclass(frozen=True)
class Setup:
    block_size: int
    mamba: bool
    num_blocks: int
    policy: SchedulingPolicy
    budget: int
    max_num_seqs: int
    threshold: int
    reserve_full_isl: bool = True
    cap: int = 0  # Cp
    max_partials: int = 0  # Mp
    min_decode_steps: int = 0  # D
    max_wait_ms: float = 0.0  # W
    target_ms: float = 0.0  # T

    @property
    def quantum(self) -> int:
        return self.block_size if self.mamba else 1

    def scheduler(self) -> Scheduler:
        scheduler = make_scheduler(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            mamba=self.mamba,
            policy=self.policy,
            max_num_batched_tokens=self.budget,
            max_num_seqs=self.max_num_seqs,
            long_prefill_token_threshold=self.threshold,
            reserve_full_isl=self.reserve_full_isl,
            max_num_prefill_tokens_per_step=self.cap,
            max_num_partial_prefills=self.max_partials,
            decode_prefill_min_decode_steps=self.min_decode_steps,
            decode_prefill_max_wait_ms=self.max_wait_ms,
            target_mixed_step_ms=self.target_ms,
        )
        scheduler.controls.model = StepTimeModel(seed_coefficients=STEP_MODEL_SEED)
        return scheduler


@st.composite
def drawn_requests(draw: st.DrawFn, *, policy: SchedulingPolicy) -> list[DrawnRequest]:
    count = draw(st.integers(1, 10))
    drawn = []
    for i in range(count):
        length = draw(st.integers(1, MAX_PROMPT))
        doc = draw(st.sampled_from((None, 0, 1)))
        shared = 0 if doc is None else draw(st.integers(0, length))
        drawn.append(
            DrawnRequest(
                index=i,
                length=length,
                doc=doc,
                shared=shared,
                max_tokens=draw(st.integers(1, MAX_OUTPUT)),
                arrival_step=draw(st.one_of(st.integers(0, 3), st.integers(0, MAX_ARRIVAL_STEP))),
                priority=draw(st.integers(0, 2)) if policy is SchedulingPolicy.PRIORITY else 0,
            )
        )
    return drawn


@st.composite
def controls(draw: st.DrawFn, quantum: int) -> dict[str, float]:
    cap = quantum * draw(st.one_of(st.just(0), st.integers(1, 8), st.integers(1, 4096 // quantum)))
    min_decode_steps = draw(st.integers(0, 4)) if cap else 0
    max_wait_ms = 0.0
    if min_decode_steps:
        max_wait_ms = draw(st.one_of(st.just(0.0), st.floats(50.0, 500.0)))
    return {
        "cap": cap,
        "max_partials": draw(st.integers(0, 3)),
        "min_decode_steps": min_decode_steps,
        "max_wait_ms": max_wait_ms,
        "target_ms": draw(st.one_of(st.just(0.0), st.floats(5.0, 50.0))),
    }


@st.composite
def scenarios(
    draw: st.DrawFn,
    *,
    controlled: bool = True,
    policies: tuple[SchedulingPolicy, ...] = tuple(SchedulingPolicy),
    large_pool: bool | None = None,
) -> tuple[Setup, list[DrawnRequest]]:
    policy = draw(st.sampled_from(policies))
    drawn = draw(drawn_requests(policy=policy))
    block_size = draw(st.sampled_from((16, 32)))
    mamba = draw(st.booleans())
    longest = max(s.length + s.max_tokens for s in drawn)
    need = math.ceil(longest / block_size) + 4  # one request alone must fit
    large = draw(st.booleans()) if large_pool is None else large_pool
    num_blocks = 4096 if large else need + draw(st.integers(0, need // 2))
    event("pool: " + ("large" if large else "small"))
    setup = Setup(
        block_size=block_size,
        mamba=mamba,
        num_blocks=num_blocks,
        policy=policy,
        budget=draw(st.sampled_from((1024, 2048, 8192))),
        max_num_seqs=draw(st.sampled_from((3, 256))),
        threshold=draw(st.sampled_from((0, 0, 512))),
        reserve_full_isl=draw(st.booleans()),
    )
    if controlled:
        setup = replace(setup, **draw(controls(setup.quantum)))
    return setup, drawn


# ----- driving --------------------------------------------------------------------------------


@dataclass
class StepRecord:
    now: float
    out: SchedulerOutput
    eligible: bool  # some running request was a decode when the step was drawn
    pending: bool  # running partial prefills or waiters when the step was drawn
    waiting: list[tuple[str, float]]  # (req_id, arrival_time) in queue order, before the step
    prefill_end: dict[str, int]  # max(prompt, num_tokens - 1) before the step
    partials_after: int  # running requests still short of their prompt end after the step
    running_after: list[str]
    waiting_after: list[str]
    bypasses_after: int  # the controller's deadline-bypass counter after the step
    grants: dict[str, int]  # the controller's last rotation grants, after the step

    @property
    def oldest_age(self) -> float:
        return max((self.now - arrival for _, arrival in self.waiting), default=0.0)

    @property
    def mixed(self) -> bool:
        """Eligible decode and prefill tokens (SPEC.md 5.1). Not `num_decode_tokens > 0`: a
        resumed request whose prefix hit reaches its last token computes that one token as a
        decode in the step that admits it, with no decode eligible at planning time."""
        return self.eligible and self.out.num_prefill_tokens > 0


@dataclass
class Run:
    records: list[StepRecord] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    unfinished: set[str] = field(default_factory=set)


def drive(scheduler: Scheduler, drawn: list[DrawnRequest], *, check_cache: bool = False) -> Run:
    """Run the trace to completion (or MAX_STEPS); requests arrive at their step's `now`."""
    engine = Engine(scheduler, fake_executor())
    arrivals = sorted(drawn, key=lambda s: s.arrival_step)
    run = Run()
    live: dict[str, Request] = {}
    for index in range(MAX_STEPS):
        now = index * DT
        batch = []
        while arrivals and arrivals[0].arrival_step <= index:
            batch.append(arrivals.pop(0))
        for order, drawn_request in enumerate(batch):
            # Distinct arrival times within a step (a real clock never ties): the priority
            # policy breaks (priority, arrival) ties by running order, as vLLM does, and two
            # tied requests that do not fit together then preempt each other forever.
            request = drawn_request.build(now - 1e-6 * (len(batch) - order))
            engine.add_request(request)
            live[request.req_id] = request
        if not arrivals and not engine.has_requests():
            break
        waiting = [(r.req_id, r.arrival_time) for r in scheduler.waiting]
        running = scheduler.running
        eligible = any(is_decode(r) for r in running)
        pending = bool(waiting) or any(not is_decode(r) for r in running)
        prefill_end = {
            req_id: max(r.num_prompt_tokens, r.num_tokens - 1) for req_id, r in live.items()
        }
        done = engine.step(now)
        for output in done.outputs:
            if output.finished:
                run.finished.add(output.req_id)
                live.pop(output.req_id, None)
        if check_cache:
            scheduler.cache.check_invariants()
        run.records.append(
            StepRecord(
                now=now,
                out=done.scheduled,
                eligible=eligible,
                pending=pending,
                waiting=waiting,
                prefill_end=prefill_end,
                partials_after=sum(1 for r in scheduler.running if not is_decode(r)),
                running_after=[r.req_id for r in scheduler.running],
                waiting_after=[r.req_id for r in scheduler.waiting],
                bypasses_after=scheduler.controls.stats.deadline_bypasses,
                grants=dict(scheduler.controls.stats.last_grants),
            )
        )
    run.unfinished = {s.req_id for s in drawn} - run.finished
    preemptions = sum(len(r.out.preempted) for r in run.records)
    event("preemptions: " + ("none" if not preemptions else "some"))
    bypassed = any(r.out.deadline_bypass for r in run.records)
    event("deadline bypasses: " + ("some" if bypassed else "none"))
    event("steps: " + str(len(run.records) // 100 * 100) + "+")
    event("mixed steps: " + ("none" if not any(r.mixed for r in run.records) else "some"))
    return run


def assert_all_finished(run: Run) -> None:
    assert not run.unfinished, f"unfinished after {len(run.records)} steps: {run.unfinished}"


class NoControls:
    """A do-nothing stand-in for the PrefillController: the plain vLLM loop."""

    enabled = False
    # Every knob the scheduler may read off the controller, off.
    cap = max_partials = min_decode_steps = since = rot = 0
    max_wait_s = target_s = 0.0

    def __init__(self, quantum: int) -> None:
        self.quantum = quantum
        self.stats = ControlStats()

    def decide_and_commit(self, **_: object) -> object:
        return UNLIMITED

    def admits(self, **_: object) -> bool:
        return True

    def observe(self, *_: object, **__: object) -> None:
        pass

    def learn(self, **_: object) -> None:
        pass


def decisions(out: SchedulerOutput) -> tuple[object, ...]:
    return (
        out.num_scheduled_tokens,
        out.new_reqs,
        out.resumed,
        out.preempted,
        out.finished_req_ids,
    )


# ----- 1. disabled equivalence ----------------------------------------------------------------


@SETTINGS
@given(scenarios(controlled=False))
def test_controls_at_zero_schedule_exactly_like_no_controller(
    scenario: tuple[Setup, list[DrawnRequest]],
) -> None:
    """Every control at 0: the same decisions, step by step, as a scheduler whose controller is
    replaced by a stand-in that decides nothing (SPEC.md 5.2 disabled equivalence, 8 item 13)."""
    setup, drawn = scenario
    controlled = setup.scheduler()
    assert not controlled.controls.enabled
    baseline = setup.scheduler()
    baseline.controls = NoControls(baseline.controls.quantum)  # type: ignore[assignment]
    with_zero = drive(controlled, drawn)
    without = drive(baseline, drawn)
    assert_all_finished(without)
    assert [decisions(r.out) for r in with_zero.records] == [
        decisions(r.out) for r in without.records
    ]
    assert with_zero.finished == without.finished


# ----- 2. budget, queue exclusivity, liveness -------------------------------------------------


@SETTINGS
@given(scenarios())
def test_budget_holds_queues_are_exclusive_and_every_request_finishes(
    scenario: tuple[Setup, list[DrawnRequest]],
) -> None:
    """Every step stays within max_num_batched_tokens, schedules a request at most once, no
    request is both running and waiting, and every request finishes within MAX_STEPS."""
    setup, drawn = scenario
    run = drive(setup.scheduler(), drawn)
    for record in run.records:
        assert sum(n for _, n in record.out.num_scheduled_tokens) <= setup.budget
        ids = [req_id for req_id, _ in record.out.num_scheduled_tokens]
        assert len(ids) == len(set(ids))
        assert len(record.running_after) == len(set(record.running_after))
        assert len(record.waiting_after) == len(set(record.waiting_after))
        assert not set(record.running_after) & set(record.waiting_after)
    assert_all_finished(run)


# ----- 3. mixed-step cap and quantum ----------------------------------------------------------


@SETTINGS
@given(scenarios())
def test_mixed_steps_carry_at_most_cp_prefill_in_whole_quanta(
    scenario: tuple[Setup, list[DrawnRequest]],
) -> None:
    """In a mixed step (eligible decode plus prefill) prefill stays within Cp and within the
    governed budget Bp; Bp and the rotation grants are multiples of q, and every prefill chunk
    ends on the q grid unless it reaches the prompt end. Steps without eligible decode carry no
    governed budget (the event counts those whose prefill went above Cp)."""
    setup, drawn = scenario
    q = setup.quantum
    run = drive(setup.scheduler(), drawn)
    for record in run.records:
        out = record.out
        assert out.mixed_budget % q == 0
        assert all(grant % q == 0 for grant in record.grants.values()), record.grants
        if not record.eligible:
            # Nothing to protect: no governed budget, no burst (the full token budget applies).
            assert out.mixed_budget == 0 and not out.decode_only and not out.deadline_bypass
        if not record.mixed:
            if setup.cap and out.num_prefill_tokens > setup.cap:
                event("prefill above Cp in a step without eligible decode")
            continue
        if setup.cap:
            assert out.num_prefill_tokens <= setup.cap
        if setup.cap or setup.target_ms:
            assert out.num_prefill_tokens <= out.mixed_budget
        for chunk in out.plan.chunks:
            end = chunk.start + len(chunk.token_ids)
            if chunk.start >= record.prefill_end[chunk.req_id]:
                continue  # a decode
            # A prefill chunk of a mixed step ends on the quantum grid unless it ends the prompt.
            assert end % q == 0 or end >= record.prefill_end[chunk.req_id], (chunk, q)
    assert_all_finished(run)


def test_prefill_may_exceed_cp_when_no_decode_is_eligible() -> None:
    """A cold start of four long prompts: no decode to protect, so the first step takes the
    whole token budget although Cp is 256."""
    scheduler = make_scheduler(
        max_num_prefill_tokens_per_step=256,
        decode_prefill_min_decode_steps=2,
        decode_prefill_max_wait_ms=100.0,
        max_num_partial_prefills=2,
    )
    engine = Engine(scheduler, fake_executor())
    for i in range(4):
        engine.add_request(make_request(f"r{i}", 3000, max_tokens=3, base=10_000 * i))
    first = engine.step(0.0).scheduled
    assert first.num_decode_tokens == 0
    assert first.num_prefill_tokens == 8192 > 256
    assert first.mixed_budget == 0


# ----- 4. partial bound -----------------------------------------------------------------------


@SETTINGS
@given(scenarios())
def test_partial_prefills_left_after_a_step_never_exceed_mp(
    scenario: tuple[Setup, list[DrawnRequest]],
) -> None:
    """Running requests still short of their prompt end after a step number at most Mp (a waiter
    that completes its prompt within its grant is a decode by then). Mp = 0 is drawn as 1."""
    setup, drawn = scenario
    setup = replace(setup, max_partials=setup.max_partials or 1)
    run = drive(setup.scheduler(), drawn)
    for record in run.records:
        assert record.partials_after <= setup.max_partials, record.out
    assert_all_finished(run)


# ----- 5. decode bursts and the deadline ------------------------------------------------------


@st.composite
def burst_scenarios(draw: st.DrawFn) -> tuple[Setup, list[DrawnRequest]]:
    setup, drawn = draw(scenarios())
    q = setup.quantum
    cap = setup.cap or q * draw(st.integers(1, 2048 // q))
    min_decode_steps = setup.min_decode_steps or draw(st.integers(1, 4))
    max_wait_ms = draw(st.one_of(st.just(0.0), st.floats(50.0, 150.0), st.floats(50.0, 500.0)))
    changes = {"cap": cap, "min_decode_steps": min_decode_steps, "max_wait_ms": max_wait_ms}
    return replace(setup, **changes), drawn


@SETTINGS
@given(burst_scenarios())
def test_d_decode_only_steps_separate_mixed_steps_unless_the_deadline_bypasses(
    scenario: tuple[Setup, list[DrawnRequest]],
) -> None:
    """Replays SPEC.md 5.2 steps 3 and 8 beside the scheduler: `since` counts decode steps since
    the last prefill release (saturating at D; reset by a step without eligible decode). A step
    is decode-only exactly when prefill is pending, since < D and the oldest waiter is younger
    than W; a bypass exactly when the same holds but the oldest waiter is >= W old. Every
    release with eligible decode follows at least D decode steps unless it is a bypass, and the
    bypass counter moves only when the bypass step really carried prefill."""
    setup, drawn = scenario
    d, w_s = setup.min_decode_steps, setup.max_wait_ms / 1000.0
    run = drive(setup.scheduler(), drawn)
    since = 0  # decode steps since the last prefill release, saturating at D (SPEC.md 5.2)
    bypasses = 0
    for record in run.records:
        out = record.out
        if out.decode_only:
            assert out.num_prefill_tokens == 0
        if not record.eligible:
            assert not out.decode_only and not out.deadline_bypass
            since = 0
            bypasses = record.bypasses_after
            continue
        burst = record.pending and since < d
        deadline = w_s > 0 and record.oldest_age >= w_s
        assert out.decode_only == (burst and not deadline), (since, record.now)
        assert out.deadline_bypass == (burst and deadline), (since, record.now)
        if out.deadline_bypass:
            assert w_s > 0 and record.oldest_age >= w_s
        # The bypass counter moves only when prefill was actually scheduled.
        expected = bypasses + (1 if out.deadline_bypass and out.num_prefill_tokens else 0)
        assert record.bypasses_after == expected
        bypasses = record.bypasses_after
        if out.num_prefill_tokens:
            # A release: at least D decode-only steps since the last one, or a deadline bypass.
            assert since >= d or out.deadline_bypass, (since, record.now)
            since = 0
        else:
            since = min(since + 1, d)
    assert_all_finished(run)


# ----- 6. fairness ----------------------------------------------------------------------------


@st.composite
def fair_scenarios(draw: st.DrawFn) -> tuple[Setup, list[DrawnRequest]]:
    """FCFS, a large pool, no partial bound and no time target: nothing but the controller can
    hold a waiter back."""
    setup, drawn = draw(scenarios(policies=(SchedulingPolicy.FCFS,), large_pool=True))
    q = setup.quantum
    changes = {
        "cap": setup.cap or q * draw(st.integers(1, 2048 // q)),
        "min_decode_steps": setup.min_decode_steps or draw(st.integers(1, 4)),
        "max_wait_ms": draw(st.one_of(st.floats(50.0, 120.0), st.floats(50.0, 500.0))),
        "max_partials": 0,
        "target_ms": 0.0,
        "max_num_seqs": 256,
    }
    return replace(setup, **changes), drawn


@SETTINGS
@given(fair_scenarios())
def test_a_waiter_gets_prefill_within_w_plus_one_step_while_decode_runs(
    scenario: tuple[Setup, list[DrawnRequest]],
) -> None:
    """Once the head waiter is W old, a decode-eligible step admits it: it loses at most one
    step (its prefix state may be the one another request materialises in that very step, which
    a lookup may not serve until the next step). Waiters behind it follow one step apart."""
    setup, drawn = scenario
    w_s = setup.max_wait_ms / 1000.0
    run = drive(setup.scheduler(), drawn)
    missed: dict[str, int] = {}  # consecutive decode-eligible steps at the head past W, unserved
    worst = 0
    for record in run.records:
        scheduled = dict(record.out.num_scheduled_tokens)
        for req_id in scheduled:
            missed.pop(req_id, None)
        if not record.eligible or not record.waiting:
            continue
        head, arrival = record.waiting[0]
        if record.now - arrival < w_s:
            continue
        event("fairness: a head waiter reached W while decode ran")
        assert not record.out.decode_only
        if head not in scheduled:
            missed[head] = missed.get(head, 0) + 1
            worst = max(worst, missed[head])
    assert worst <= 1, f"a waiter was held {worst} steps past W={setup.max_wait_ms} ms"
    assert_all_finished(run)


def test_the_deadline_admits_a_waiter_under_a_tight_time_target() -> None:
    """Five decodes predicted at 4 ms + 5 x 0.2 ms = T: the time grant is 0 in every mixed step.
    W = 50 ms must still admit the waiter within about W plus one step."""
    scheduler = make_scheduler(
        max_num_prefill_tokens_per_step=256,
        decode_prefill_min_decode_steps=1,
        decode_prefill_max_wait_ms=50.0,
        target_mixed_step_ms=5.0,
    )
    scheduler.controls.model = StepTimeModel(seed_coefficients=STEP_MODEL_SEED)
    engine = Engine(scheduler, fake_executor())
    for i in range(5):
        engine.add_request(make_request(f"d{i}", 8, max_tokens=40, base=100 * i))
    engine.step(0.0)
    engine.add_request(make_request("late", 100, max_tokens=1, arrival=DT, base=9000))
    admitted_at = None
    for index in range(1, 36):
        out = engine.step(index * DT).scheduled
        assert out.num_decode_tokens == 5  # decode stays eligible throughout
        if any(req_id == "late" for req_id, _ in out.new_reqs):
            admitted_at = index * DT
            break
    assert admitted_at is not None
    assert admitted_at - DT <= 0.050 + DT + 1e-9


# ----- 7. cache invariants --------------------------------------------------------------------


@SETTINGS
@given(scenarios())
def test_cache_invariants_hold_after_every_step(
    scenario: tuple[Setup, list[DrawnRequest]],
) -> None:
    """`check_invariants()` of the KV cache after every step of controlled, preempting runs."""
    setup, drawn = scenario
    run = drive(setup.scheduler(), drawn, check_cache=True)
    assert_all_finished(run)
