"""Agent-aware controls: session ids, tool-call TTL pinning, program-level priority and
KV-aware admission. Each is off by default (vLLM's schedule)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from hybridserve.core.config import ProgramPriority, SchedulerConfig
from hybridserve.core.errors import ConfigError, RequestError
from hybridserve.core.request import Request, SamplingParams, session_key
from hybridserve.engine import Engine
from hybridserve.scheduler import Scheduler
from hybridserve.scheduler.queue import ProgramQueue
from hybridserve.scheduler.sessions import ToolGapModel
from hybridserve.server.protocol import CompletionRequest
from tests.conftest import fake_executor, make_scheduler

torch.set_num_threads(1)

DT = 0.01


def turn(
    req_id: str,
    tokens: tuple[int, ...],
    *,
    session: str | None,
    max_tokens: int = 2,
    arrival: float = 0.0,
) -> Request:
    return Request(
        req_id=req_id,
        prompt_token_ids=tokens,
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        arrival_time=arrival,
        session_id=session,
    )


class Driver:
    """Steps an engine on a DT clock; remembers each request's admission hit and time."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.engine = Engine(scheduler, fake_executor())
        self.now = 0.0
        self.hits: dict[str, int] = {}
        self.admitted_at: dict[str, float] = {}
        self.preemptions = 0

    def step(self) -> None:
        out = self.engine.step(self.now)
        for req_id, hit in out.scheduled.new_reqs:
            self.hits[req_id] = hit
            self.admitted_at[req_id] = self.now
        self.preemptions += len(out.scheduled.preempted)
        self.now += DT
        self.scheduler.cache.check_invariants()

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_requests():
                return
            self.step()
        raise AssertionError("the trace did not finish")


# ----- session ids --------------------------------------------------------------------------


def test_request_session_id_must_be_a_non_empty_string() -> None:
    with pytest.raises(RequestError, match="session_id"):
        turn("a", (1, 2), session="")
    assert turn("a", (1, 2), session="job-1").session_id == "job-1"


def test_server_takes_the_session_id_from_the_user_field() -> None:
    from starlette.datastructures import Headers

    from hybridserve.server.chat import session_id

    for user, expected in (("agent-7", "agent-7"), (None, None), ("", None)):
        body = CompletionRequest(model="m", prompt=[1, 2, 3], user=user)
        assert session_id(body, Headers()) == expected
    body = CompletionRequest(model="m", prompt=[1, 2, 3], user="agent-7")
    assert session_id(body, Headers({"X-Session-Id": "job-1"})) == "agent-7"  # user wins


# ----- configuration ------------------------------------------------------------------------


def test_agent_controls_are_off_by_default() -> None:
    config = SchedulerConfig()
    assert config.kv_pin_fraction == 0 and not config.pins_kv
    assert config.program_priority is ProgramPriority.OFF
    assert config.kv_aware_admission is False
    assert config.kv_pin_exact_tail is False
    scheduler = make_scheduler()
    assert not scheduler.pinning and scheduler.program_queue is None


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"kv_pin_fraction": 1.5}, "kv_pin_fraction"),
        ({"kv_pin_fraction": -0.1}, "kv_pin_fraction"),
        ({"kv_pin_max_ttl_s": 0}, "kv_pin_max_ttl_s"),
        ({"kv_pin_ttl_quantile": 0}, "kv_pin_ttl_quantile"),
        ({"program_priority": "sjf"}, "program_priority"),
        ({"program_priority": "plas", "policy": "priority"}, "program_priority"),
        ({"program_priority_max_wait_s": 0.0}, "program_priority_max_wait_s"),
        ({"kv_admission_horizon_tokens": 0}, "kv_admission_horizon_tokens"),
        ({"kv_aware_admission": 1}, "kv_aware_admission"),
        ({"kv_pin_exact_tail": True}, "kv_pin_exact_tail"),  # needs a pin fraction
        ({"kv_pin_exact_tail": 1, "kv_pin_fraction": 0.5}, "kv_pin_exact_tail"),
    ],
)
def test_bad_agent_control_values_are_rejected_by_name(
    fields: dict[str, object], name: str
) -> None:
    with pytest.raises(ConfigError, match=name):
        SchedulerConfig(**fields)  # type: ignore[arg-type]


# ----- tool-call TTL pinning ----------------------------------------------------------------


def test_ttl_is_a_high_quantile_of_observed_gaps_capped() -> None:
    model = ToolGapModel(quantile=0.9, cap_s=5.0)
    assert model.ttl("s") == 5.0  # nothing observed yet: the cap
    for i in range(10):
        model.on_finish("s", 10.0 * i)
        model.on_arrival("s", 10.0 * i + (i + 1) * 0.1)  # gaps 0.1 .. 1.0
    assert model.ttl("s") == pytest.approx(0.9)
    assert model.ttl("other") == pytest.approx(0.9)  # falls back to every session's gaps
    model.on_finish("long", 0.0)
    for _ in range(4):
        model.on_finish("long", 0.0)
        model.on_arrival("long", 60.0)
    assert model.ttl("long") == 5.0  # capped


def _eviction_trace(driver: Driver, *, mamba_tokens: int = 0) -> int:
    """Turn 1 of session s, then traffic that evicts its cached blocks when nothing holds
    them, then turn 2 of s (turn 1's tokens plus more). Returns turn 2's hit."""
    sched = driver.scheduler
    first = tuple(range(1000, 1000 + 80 + mamba_tokens))
    sched.add_request(turn("s.t1", first, session="s", arrival=driver.now))
    driver.run()
    filler = sched.cache.num_free_blocks - sched.cache.num_pinned_blocks
    # Two fillers: the first uses the never-used blocks, the second evicts the oldest cached.
    for index in range(2):
        length = (filler - 2) * 16 - 8
        tokens = tuple(range(10_000 * (index + 2), 10_000 * (index + 2) + length))
        sched.add_request(turn(f"f{index}", tokens, session=None, arrival=driver.now))
        driver.run()
    second = (*first, 2, 3, *range(5000, 5040))
    sched.add_request(turn("s.t2", second, session="s", arrival=driver.now))
    driver.run()
    return driver.hits["s.t2"]


@pytest.mark.parametrize("mamba", [False, True], ids=["full-attention", "hybrid-mamba"])
def test_a_pinned_prefix_survives_eviction_pressure_that_evicts_it_unpinned(mamba: bool) -> None:
    unpinned = Driver(make_scheduler(num_blocks=40, mamba=mamba))
    pinned = Driver(make_scheduler(num_blocks=40, mamba=mamba, kv_pin_fraction=0.5))
    assert _eviction_trace(unpinned) == 0
    hit = _eviction_trace(pinned)
    assert hit >= 64  # the first turn's full blocks, and for the hybrid model its state
    assert pinned.scheduler.cache.pin_stats.released_on_return == 1
    assert pinned.scheduler.cache.num_pins == 1  # turn 2 is pinned in its turn


def test_pinning_never_exceeds_its_pool_fraction() -> None:
    rng = random.Random(7)
    sched = make_scheduler(num_blocks=200, kv_pin_fraction=0.2, kv_pin_max_ttl_s=0.5)
    driver = Driver(sched)
    limit = int(0.2 * 199)
    assert sched.max_pinned_blocks == limit
    peak = 0
    for index in range(120):
        session = f"s{rng.randrange(30)}"
        length = rng.randrange(20, 300)
        tokens = tuple(range(100_000 * (index + 1), 100_000 * (index + 1) + length))
        sched.add_request(turn(f"r{index}", tokens, session=session, arrival=driver.now))
        for _ in range(rng.randrange(1, 4)):
            driver.step()
            assert sched.cache.num_pinned_blocks <= limit
            peak = max(peak, sched.cache.num_pinned_blocks)
    driver.run()
    assert sched.cache.pin_stats.refused > 0  # the bound was reached and held
    assert peak > limit // 2


def test_pinning_never_pins_past_the_ttl() -> None:
    sched = make_scheduler(num_blocks=100, kv_pin_fraction=0.5, kv_pin_max_ttl_s=0.25)
    driver = Driver(sched)
    sched.add_request(turn("s.t1", tuple(range(64)), session="s"))
    driver.run()
    deadline = sched.cache.pins.deadline(session_key(None, "s"))
    assert deadline is not None and sched.cache.num_pinned_blocks == 4
    assert deadline <= driver.now + 0.25
    while driver.now < deadline:
        assert sched.cache.num_pinned_blocks == 4
        sched.schedule(driver.now)
        driver.now += DT
    sched.schedule(driver.now)
    assert sched.cache.num_pinned_blocks == 0
    assert sched.cache.pin_stats.released_on_ttl == 1
    assert sched.cache.num_free_blocks == 99


def test_a_returned_session_keeps_its_pin_until_its_turn_is_admitted() -> None:
    sched = make_scheduler(num_blocks=100, max_num_seqs=1, kv_pin_fraction=0.5)
    driver = Driver(sched)
    sched.add_request(turn("s.t1", tuple(range(64)), session="s"))
    driver.run()
    sched.add_request(turn("busy", tuple(range(900, 910)), session=None, max_tokens=40))
    driver.step()
    # Back at once (a gap of 0 s: the TTL quantile is 0), but it waits behind `busy`.
    sched.add_request(turn("s.t2", (*range(64), 1, 2, 3), session="s", arrival=driver.now))
    for _ in range(10):
        driver.step()
        assert "s.t2" not in driver.admitted_at and sched.cache.num_pinned_blocks == 4
    driver.run()
    assert driver.hits["s.t2"] == 64
    assert sched.cache.pin_stats.released_on_return == 1


def test_pins_are_released_rather_than_stall_admission() -> None:
    sched = make_scheduler(num_blocks=30, kv_pin_fraction=1.0)
    driver = Driver(sched)
    for index in range(3):
        base = 1000 * (index + 1)
        sched.add_request(turn(f"s{index}", tuple(range(base, base + 100)), session=f"s{index}"))
    driver.run()
    assert sched.cache.num_pinned_blocks > 15
    big = tuple(range(50_000, 50_000 + 27 * 16 - 8))  # needs 27 of 29 blocks
    sched.add_request(turn("big", big, session=None, arrival=driver.now))
    driver.step()
    assert "big" in driver.admitted_at
    assert sched.cache.pin_stats.released_on_pressure >= 1


def test_pinning_off_keeps_the_free_queue_order() -> None:
    def trace(**config: object) -> list[int]:
        sched = make_scheduler(num_blocks=64, **config)
        driver = Driver(sched)
        for index in range(6):
            base = 1000 * (index % 3)
            sched.add_request(
                turn(
                    f"r{index}",
                    tuple(range(base, base + 90 + index)),
                    session=f"s{index % 3}",
                    arrival=driver.now,
                )
            )
            driver.step()
        driver.run()
        return sched.cache.pool.free_queue.block_ids()

    baseline = trace()
    assert trace(kv_pin_fraction=0.0, kv_pin_max_ttl_s=1.0) == baseline
    assert trace(kv_pin_fraction=0.5) != baseline  # the control is what changes it


# ----- exact tails --------------------------------------------------------------------------


def _two_turns(
    mamba: bool, *, second: tuple[int, ...] | None = None, **config: object
) -> tuple[Driver, Request, int]:
    """Turn 1 of session s (70 prompt tokens, 5 answer tokens: 74 computed, inside a 16-token
    block), then turn 2: turn 1's tokens and 10 more, or `second`. Returns turn 2's hit."""
    driver = Driver(make_scheduler(num_blocks=64, mamba=mamba, kv_pin_fraction=0.5, **config))
    first = turn("s.t1", tuple(range(1000, 1070)), session="s", max_tokens=5)
    driver.scheduler.add_request(first)
    driver.run()
    tokens = second if second is not None else (*first.token_ids, *range(5000, 5010))
    driver.scheduler.add_request(turn("s.t2", tokens, session="s", arrival=driver.now))
    driver.run()
    return driver, first, driver.hits["s.t2"]


@pytest.mark.parametrize("mamba", [False, True], ids=["full-attention", "hybrid-mamba"])
def test_an_exact_tail_resumes_the_next_turn_at_the_last_turns_end(mamba: bool) -> None:
    _, first, pinned_hit = _two_turns(mamba)
    driver, _, hit = _two_turns(mamba, kv_pin_exact_tail=True)
    assert first.num_computed_tokens == 74
    assert hit == 74  # mid-block: the partial block and the running state were kept
    assert pinned_hit <= 64  # a pin alone: the last whole block with a retained state
    cache = driver.scheduler.cache
    assert (cache.pin_stats.tails, cache.pin_stats.tail_hits) == (2, 1)
    assert driver.scheduler.metrics_snapshot()["hybridserve:kv_pin_tail_hits_total"] == 1


@pytest.mark.parametrize("mamba", [False, True], ids=["full-attention", "hybrid-mamba"])
def test_a_prompt_that_leaves_the_last_turn_inside_its_tail_gets_no_tail_hit(
    mamba: bool,
) -> None:
    tokens = (*range(1000, 1070), 7, 8, 9, *range(5000, 5010))  # not turn 1's answer
    _, _, plain = _two_turns(mamba, second=tokens)
    driver, _, hit = _two_turns(mamba, second=tokens, kv_pin_exact_tail=True)
    assert hit == plain and hit < 70
    assert driver.scheduler.cache.pin_stats.tail_hits == 0


def _tail_scheduler(num_blocks: int, *, fraction: float, ttl_s: float) -> Scheduler:
    """A hybrid (full attention + Mamba) scheduler pinning with exact tails."""
    return make_scheduler(
        num_blocks=num_blocks,
        mamba=True,
        kv_pin_fraction=fraction,
        kv_pin_max_ttl_s=ttl_s,
        kv_pin_exact_tail=True,
    )


def test_an_exact_tail_is_released_with_its_pin_at_the_ttl() -> None:
    sched = _tail_scheduler(100, fraction=0.5, ttl_s=0.2)
    driver = Driver(sched)
    sched.add_request(turn("s.t1", tuple(range(70)), session="s", max_tokens=5))
    driver.run()
    # 74 tokens: 5 attention blocks (the fifth partial), the running state at 74 and the
    # state at 64 that the prefix hit lands on.
    assert sched.cache.num_pinned_blocks == 7
    while sched.cache.num_pins:
        sched.schedule(driver.now)
        driver.now += DT
    assert sched.cache.pin_stats.released_on_ttl == 1
    assert sched.cache.num_free_blocks == 99
    sched.add_request(turn("s.t2", (*range(70), 7, 8, 9, 10, 11, 1, 2), session="s"))
    driver.run()
    assert sched.cache.pin_stats.tail_hits == 0 and driver.hits["s.t2"] < 74


def test_exact_tails_turn_themselves_off_for_a_layout_that_cannot_hold_one() -> None:
    from hybridserve.kvcache import CacheLayout, KVCacheManager
    from hybridserve.kvcache.spec import FullAttentionSpec, SlidingWindowSpec

    layout = CacheLayout(
        groups=(SlidingWindowSpec(block_size=16, window=64), FullAttentionSpec(block_size=16)),
        num_blocks=64,
    )
    config = SchedulerConfig(kv_pin_fraction=0.5, kv_pin_exact_tail=True)
    scheduler = Scheduler(config, KVCacheManager(layout))
    assert not scheduler.exact_tails and scheduler.pinning
    (notice,) = scheduler.notices
    assert "kv_pin_exact_tail is off" in notice and "group 0 is swa" in notice


def test_exact_tails_count_against_the_pin_fraction() -> None:
    rng = random.Random(11)
    sched = _tail_scheduler(200, fraction=0.2, ttl_s=0.5)
    driver = Driver(sched)
    limit = sched.max_pinned_blocks
    for index in range(80):
        length = rng.randrange(20, 300)
        tokens = tuple(range(100_000 * (index + 1), 100_000 * (index + 1) + length))
        sched.add_request(turn(f"r{index}", tokens, session=f"s{rng.randrange(20)}"))
        for _ in range(rng.randrange(1, 4)):
            driver.step()
            assert sched.cache.num_pinned_blocks <= limit
    driver.run()
    assert sched.cache.pin_stats.refused > 0 and sched.cache.pin_stats.tails > 0


# ----- program-level priority ---------------------------------------------------------------


def test_plas_orders_waiting_turns_by_their_session_attained_service() -> None:
    queue = ProgramQueue(ProgramPriority.PLAS, max_wait_s=100.0)
    heavy = turn("h.t2", (1,), session="h", arrival=0.0)
    light = turn("l.t1", (2,), session="l", arrival=1.0)
    queue.add_service(turn("h.t1", (1,), session="h"), 500)
    queue.add(heavy)
    queue.add(light)
    assert queue.peek() is light  # later, but its program has had less service
    assert list(queue) == [light, heavy]
    queue.add_service(light, 1000)
    assert queue.pop() is heavy


def test_program_fcfs_orders_waiting_turns_by_their_session_arrival() -> None:
    queue = ProgramQueue(ProgramPriority.FCFS, max_wait_s=100.0)
    queue.add(turn("old.t1", (1,), session="old", arrival=0.0))
    queue.pop()
    newer = turn("new.t1", (2,), session="new", arrival=1.0)
    older = turn("old.t2", (3,), session="old", arrival=2.0)
    queue.add(newer)
    queue.add(older)
    assert queue.pop() is older  # its program arrived first
    assert queue.pop() is newer


def test_an_aged_turn_goes_first_and_preempted_ones_lead() -> None:
    queue = ProgramQueue(ProgramPriority.PLAS, max_wait_s=5.0)
    starved = turn("h.t2", (1,), session="h", arrival=0.0)
    queue.add_service(starved, 10_000)
    fresh = turn("n.t1", (2,), session="n", arrival=4.0)
    queue.add(starved)
    queue.add(fresh)
    queue.now = 4.9
    assert queue.peek() is fresh
    queue.now = 5.0
    assert queue.peek() is starved
    preempted = turn("p.t1", (3,), session="p", arrival=4.5)
    queue.prepend(preempted)
    assert list(queue) == [preempted, starved, fresh]
    queue.remove(starved)
    assert len(queue) == 2


def test_program_priority_admits_the_light_session_ahead_in_the_scheduler() -> None:
    sched = make_scheduler(num_blocks=400, max_num_seqs=1, program_priority="plas")
    driver = Driver(sched)
    sched.add_request(turn("h.t1", tuple(range(500)), session="h", max_tokens=4))
    driver.run()
    sched.add_request(turn("blocker", tuple(range(7000, 7010)), session="b", max_tokens=3))
    driver.step()
    sched.add_request(turn("h.t2", tuple(range(9000, 9010)), session="h", arrival=driver.now))
    sched.add_request(turn("l.t1", tuple(range(8000, 8010)), session="l", arrival=driver.now))
    driver.run()
    assert driver.admitted_at["l.t1"] < driver.admitted_at["h.t2"]
    fcfs = Driver(make_scheduler(num_blocks=400, max_num_seqs=1))
    fcfs.scheduler.add_request(turn("blocker", tuple(range(7000, 7010)), session="b", max_tokens=3))
    fcfs.step()
    fcfs.scheduler.add_request(turn("h.t2", tuple(range(9000, 9010)), session="h", arrival=DT))
    fcfs.scheduler.add_request(turn("l.t1", tuple(range(8000, 8010)), session="l", arrival=DT))
    fcfs.run()
    assert fcfs.admitted_at["h.t2"] < fcfs.admitted_at["l.t1"]


# ----- KV-aware admission -------------------------------------------------------------------


def _overload(**config: object) -> Driver:
    sched = make_scheduler(num_blocks=120, **config)
    driver = Driver(sched)
    for index in range(16):
        base = 10_000 * (index + 1)
        sched.add_request(
            turn(f"r{index}", tuple(range(base, base + 200)), session=None, max_tokens=300)
        )
    driver.run()
    return driver


def test_kv_aware_admission_reduces_preemptions_in_overload() -> None:
    baseline = _overload()
    aware = _overload(kv_aware_admission=True)
    assert baseline.preemptions > 5
    assert aware.preemptions < baseline.preemptions
    assert aware.preemptions == 0
    assert len(aware.admitted_at) == 16  # everything still runs


def test_a_simulated_run_reports_pin_counters_only_when_pinning() -> None:
    from hybridserve.sim.deployment import SimConfig
    from hybridserve.sim.run import run_simulation
    from hybridserve.sim.workload import AgentParams

    base = SimConfig(
        duration_s=60.0, warmup_s=0.0, agents=AgentParams(num_agents=2), preset="baseline"
    )
    off = run_simulation(base).summary
    on = run_simulation(replace(base, overrides=(("kv_pin_fraction", 0.2),))).summary
    assert not any(key.startswith("kv_pins_") for key in off)
    assert on["kv_pins_pinned"] > 0
    assert on["kv_pins_released_on_return"] > 0
