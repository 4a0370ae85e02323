"""Exact tails under random multi-session traffic and pool pressure.

Turns of a few sessions either extend their session's last turn (its prompt and answer plus new
tokens) or leave it at a drawn position; fresh sessions and session-less fillers compete for a
small pool. With 16-token blocks and fine-grained hits off, only an exact tail can give a hit
that ends inside a block. Properties: every such hit is exactly where the session's last turn
ended and the prompt really starts with that turn's tokens; the cache's invariants hold after
every step; every request finishes; once every pin is gone, every block is free. With a host
tier a released pin's end goes to the host and comes back: its hits are just as exact.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine import Engine
from tests.conftest import fake_executor, make_scheduler

torch.set_num_threads(1)

DT = 0.01
BLOCK = 16
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, database=None)

turns = st.lists(
    st.tuples(
        st.integers(0, 3),  # session (3: no session)
        st.booleans(),  # extend the session's last turn (else leave it inside)
        st.integers(1, 60),  # new tokens
        st.integers(1, 6),  # answer tokens
        st.integers(0, 3),  # steps before the next turn arrives
    ),
    min_size=2,
    max_size=14,
)


@SETTINGS
@given(
    trace=turns,
    mamba=st.booleans(),
    num_blocks=st.integers(24, 64),
    host_blocks=st.sampled_from((0, 2, 64)),
)
def test_exact_tail_hits_are_exact_and_leak_nothing(
    trace: list[tuple[int, bool, int, int, int]], mamba: bool, num_blocks: int, host_blocks: int
) -> None:
    sched = make_scheduler(
        block_size=BLOCK,
        num_blocks=num_blocks,
        mamba=mamba,
        host_blocks=host_blocks,
        kv_pin_fraction=0.5,
        kv_pin_max_ttl_s=0.3,
        kv_pin_exact_tail=True,
    )
    engine = Engine(sched, fake_executor())
    now, fresh = 0.0, 10_000
    last: dict[str, Request] = {}  # a session's last finished turn
    sent: dict[str, Request] = {}
    hits: dict[str, tuple[int, Request | None]] = {}  # hit, the session's last turn then
    in_flight: dict[str | None, Request] = {}
    finished: set[str] = set()

    def step() -> None:
        nonlocal now
        out = engine.step(now)
        for req_id, hit in out.scheduled.new_reqs:
            request = sent[req_id]
            before = last.get(request.session_id) if request.session_id else None
            hits[req_id] = (hit, before)
        for done in out.scheduled.finished_req_ids:
            finished.add(done)
            request = sent[done]
            if request.session_id is not None:
                last[request.session_id] = request
        sched.cache.check_invariants()
        now += DT

    for index, (session, extend, new, answer, gap) in enumerate(trace):
        sid = None if session == 3 else f"s{session}"
        # An agent sends its next turn only after its last one finished.
        for _ in range(5_000):
            if sid not in in_flight or in_flight[sid].req_id in finished:
                break
            step()
        previous = last.get(sid) if sid is not None else None
        kept: list[int] = []
        if previous is not None:
            cut = (
                len(previous.token_ids) if extend else max(len(previous.token_ids) - new % 7 - 2, 1)
            )
            kept = previous.token_ids[:cut]
        prompt = (*kept, *range(fresh, fresh + new))
        fresh += new
        request = Request(
            req_id=f"r{index}",
            prompt_token_ids=tuple(prompt),
            sampling=SamplingParams(max_tokens=answer, ignore_eos=True),
            arrival_time=now,
            session_id=sid,
        )
        if len(prompt) + answer + 1 > (num_blocks - 2) * BLOCK // 2:
            continue  # would never fit this pool beside its siblings
        sent[request.req_id] = request
        in_flight[sid] = request
        sched.add_request(request)
        for _ in range(gap):
            step()
    for _ in range(5_000):
        if not engine.has_requests():
            break
        step()
    assert not engine.has_requests(), "every request finishes"
    assert finished == set(sent)
    for req_id, (hit, before) in hits.items():
        if hit % BLOCK:
            request = sent[req_id]
            assert before is not None, f"{req_id}: a mid-block hit with no earlier turn"
            end = before.num_computed_tokens
            assert hit == end
            assert list(request.prompt_token_ids[:end]) == before.token_ids[:end]
    while sched.cache.num_pins:
        sched.schedule(now)
        now += DT
    assert sched.cache.num_free_blocks == num_blocks - 1
