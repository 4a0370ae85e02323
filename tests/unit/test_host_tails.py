"""Exact tails through the host tier, rule by rule: a pin released before its session returns
sends the turn's end to the host, the next turn resumes there, the tail keys are private to the
engine and leave both tiers once used, and a host that cannot take the end keeps nothing."""

from __future__ import annotations

import hashlib

import pytest

from hybridserve.core.request import Request, RequestStatus, SamplingParams
from hybridserve.kvcache.events import BlockRemoved, BlockStored, KVEvent, attach_events
from hybridserve.kvcache.hashing import is_tail_key, tail_key
from hybridserve.scheduler import Scheduler
from tests.conftest import make_scheduler
from tests.unit.test_agent_controls import Driver as Stepper

FIRST_PROMPT, FIRST_ANSWER = 31, 3
END = FIRST_PROMPT + FIRST_ANSWER - 1  # the first turn's computed tokens: 33, inside a block
BOUNDARY = FIRST_PROMPT // 4 * 4  # where the cache kept the first turn's state: 28


def _scheduler(*, host_blocks: int, num_blocks: int = 34, ttl: float = 30.0) -> Scheduler:
    return make_scheduler(
        block_size=4,
        num_blocks=num_blocks,
        mamba=True,
        host_blocks=host_blocks,
        kv_pin_fraction=0.5,
        kv_pin_exact_tail=True,
        kv_pin_max_ttl_s=ttl,
        max_num_batched_tokens=64,
        max_num_seqs=4,
    )


class Driver(Stepper):
    """`test_agent_controls`' stepper (10 ms a step, admissions' hits), a request at a time."""

    def send(self, request: Request) -> Request:
        self.engine.add_request(request)
        self.run()
        return request


def _request(req_id: str, prompt: tuple[int, ...], session: str | None = None) -> Request:
    sampling = SamplingParams(max_tokens=FIRST_ANSWER if req_id == "t1" else 2, ignore_eos=True)
    return Request(req_id=req_id, prompt_token_ids=prompt, sampling=sampling, session_id=session)


def _session(driver: Driver, *, filler: int) -> Request:
    """A first turn, two 'filler'-token prompts of no session, and the session's next turn."""
    first = driver.send(_request("t1", tuple(range(FIRST_PROMPT)), "s0"))
    for i in range(2):
        driver.send(_request(f"f{i}", tuple(range(1000 + 100 * i, 1000 + 100 * i + filler))))
    return driver.send(_request("t2", (*first.token_ids, 7, 7, 7, 7, 7), "s0"))


@pytest.mark.parametrize("host_blocks", [64, 0], ids=["host", "no_host"])
def test_a_pin_released_for_room_resumes_at_the_exact_end_only_with_a_host(
    host_blocks: int,
) -> None:
    driver = Driver(_scheduler(host_blocks=host_blocks))
    _session(driver, filler=100)  # the fillers need the room the pin holds
    stats = driver.scheduler.cache.pin_stats
    assert stats.released_on_pressure >= 1
    if host_blocks:
        assert driver.hits["t2"] == END
        assert stats.tails_to_host >= 1 and stats.host_tail_hits == 1
        host = driver.scheduler.cache.metrics_snapshot()["host"]
        assert isinstance(host, dict) and host["hit_tokens"] == END
        counters = driver.scheduler.metrics_snapshot()
        assert counters["hybridserve:kv_pin_host_tail_hits_total"] == 1
        assert counters["hybridserve:kv_pin_tails_to_host_total"] == stats.tails_to_host
    else:
        assert driver.hits["t2"] < BOUNDARY  # the fillers evicted the boundary too
        assert stats.tails_to_host == 0 and stats.host_tail_hits == 0


def test_a_pin_past_its_ttl_resumes_at_the_exact_end_from_the_host() -> None:
    """The TTL ran out while the whole blocks stayed on the device: the host serves the end's
    partial block and state, the device the rest."""
    driver = Driver(_scheduler(host_blocks=64, num_blocks=40, ttl=0.02))
    _session(driver, filler=40)
    stats = driver.scheduler.cache.pin_stats
    assert stats.released_on_ttl >= 1 and stats.host_tail_hits == 1
    assert driver.hits["t2"] == END
    host = driver.scheduler.cache.metrics_snapshot()["host"]
    assert isinstance(host, dict) and host["hit_tokens"] == END - BOUNDARY


def test_tail_keys_are_never_a_block_hash_nor_a_kv_event() -> None:
    key = tail_key("session", END, b"h" * 32, 1, -1)
    assert is_tail_key(key)
    assert not is_tail_key(hashlib.sha256(b"x").digest() + key[-4:])
    assert not is_tail_key(bytes(16) + key[-4:])
    scheduler = _scheduler(host_blocks=64)
    events: list[KVEvent] = []
    attach_events(scheduler.cache, events.append)
    driver = Driver(scheduler)
    _session(driver, filler=100)
    assert scheduler.cache.pin_stats.host_tail_hits == 1
    named = [
        h for e in events if isinstance(e, (BlockStored, BlockRemoved)) for h in e.block_hashes
    ]
    assert named and all(len(h) == 32 for h in named)


def test_a_used_end_leaves_both_tiers() -> None:
    scheduler = _scheduler(host_blocks=64)
    driver = Driver(scheduler)
    first = driver.send(_request("t1", tuple(range(FIRST_PROMPT)), "s0"))
    for i in range(2):
        driver.send(_request(f"f{i}", tuple(range(1000 + 100 * i, 1100 + 100 * i))))
    cache, host = scheduler.cache, scheduler.cache.host
    assert host is not None
    kept = [k for k in host._entries if is_tail_key(k)]
    assert kept, "the released pin's end is on the host"
    driver.send(_request("t2", (*first.token_ids, 7, 7, 7, 7, 7), "s0"))
    assert driver.hits["t2"] == END
    assert not set(kept) & (set(host._entries) | set(cache.pool._cached))


def test_a_host_that_cannot_take_the_whole_end_keeps_none_of_it() -> None:
    """One host slot for two blocks (the partial block and the state): nothing is kept, and
    the next turn resumes where the device alone can."""
    driver = Driver(_scheduler(host_blocks=1, num_blocks=40, ttl=0.02))
    _session(driver, filler=40)
    stats = driver.scheduler.cache.pin_stats
    assert stats.released_on_ttl >= 1
    assert stats.host_tail_hits == 0
    assert driver.hits["t2"] == BOUNDARY
    host = driver.scheduler.cache.host
    assert host is not None and host.stats.dropped == 2  # both saves given up


def test_a_session_whose_own_pin_is_in_the_way_is_admitted_when_nothing_runs() -> None:
    """The next turn does not extend the last one, so the session's pin holds blocks its hit
    cannot use, and without them the turn does not fit: with nothing running, the pin goes
    (before, the turn waited for itself for good)."""
    scheduler = make_scheduler(
        block_size=4, num_blocks=30, kv_pin_fraction=0.5, kv_pin_exact_tail=True
    )
    driver = Driver(scheduler)
    driver.send(_request("t1", tuple(range(40)), "s0"))
    assert scheduler.cache.num_pins == 1
    driver.send(_request("t2", tuple(range(500, 576)), "s0"))
    assert scheduler.cache.pin_stats.released_on_pressure == 1


def test_a_pin_released_for_a_prefetch_whose_end_takes_the_hits_host_slots() -> None:
    """The head waiter's hit is partly on a full host and its loads need room: releasing
    another session's pin sends that pin's end to the host, whose saves drop keys the hit
    named. The prefetch looks the hit up again (it used to claim a dropped key and stop the
    engine with 'HostBlock(...) is not on the host')."""
    scheduler = _scheduler(host_blocks=6, num_blocks=24)
    driver = Driver(scheduler)

    def turn(req_id: str, prompt: tuple[int, ...], session: str | None = None) -> Request:
        sampling = SamplingParams(max_tokens=3, ignore_eos=True)
        request = Request(
            req_id=req_id, prompt_token_ids=prompt, sampling=sampling, session_id=session
        )
        return driver.send(request)

    first = turn("t1", tuple(range(31)), "s0")
    turn("f0", tuple(range(1000, 1040)))
    turn("b1", tuple(range(2000, 2029)), "s1")
    stats = scheduler.cache.pin_stats
    released = stats.released_on_pressure
    second = turn("t2", (*first.token_ids, *range(3000, 3040)), "s0")
    assert stats.released_on_pressure > released and stats.tails_to_host >= 1
    assert second.status is RequestStatus.FINISHED_LENGTH and driver.hits["t2"] % 4 == 0
    scheduler.cache.check_invariants()
