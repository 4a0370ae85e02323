"""Program-level priority is starvation-free: every waiting turn is admitted within a bound.

One sequence slot and a large pool: each request runs alone, prefills in one step and decodes
the rest, so it holds the slot at most MAX_OUTPUT + 1 steps (S). A trace draws turns of a few
sessions (some given much earlier service, so that PLAS ranks them last) and a flood of fresh
sessions, one per step, that outpaces the slot: without the age cap a heavy session's turn waits
until the flood ends. With it, a turn that has waited W goes ahead of every younger one, and
only turns that arrived before it (at most `earlier` of them) plus the one running can still
go first, so it is admitted within W + (earlier + 1) * S steps (plus one step of clock slack).
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
MAX_OUTPUT = 4
SERVICE_STEPS = MAX_OUTPUT + 1
FLOOD_STEPS = 120

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None)

turns = st.lists(
    st.tuples(
        st.integers(0, 40),  # arrival step
        st.integers(0, 3),  # session
        st.integers(1, 200),  # prompt tokens
        st.integers(1, MAX_OUTPUT),  # output tokens
    ),
    min_size=1,
    max_size=12,
)


def run_trace(
    mode: str, max_wait_s: float, trace: list[tuple[int, int, int, int]], heavy: int
) -> dict[str, tuple[float, float, int]]:
    """Returns per request: arrival, admission time, and how many arrived at or before it."""
    sched = make_scheduler(
        num_blocks=8192,
        max_num_seqs=1,
        program_priority=mode,
        program_priority_max_wait_s=max_wait_s,
    )
    assert sched.program_queue is not None
    for session in range(heavy):
        sched.program_queue.add_service(_request("x", 0, f"s{session}", 1, 1, 0), 10**6)
    arrivals: list[tuple[int, Request]] = []
    for index, (step, session, length, output) in enumerate(trace):
        request = _request(f"t{index}", step, f"s{session}", length, output, index + 1)
        arrivals.append((step, request))
    for step in range(FLOOD_STEPS):
        request = _request(f"f{step}", step, f"fresh{step}", 3, MAX_OUTPUT, 1000 + step)
        arrivals.append((step, request))
    arrivals.sort(key=lambda item: item[0])
    engine = Engine(sched, fake_executor())
    admitted: dict[str, float] = {}
    cursor, step = 0, 0
    while cursor < len(arrivals) or engine.has_requests():
        while cursor < len(arrivals) and arrivals[cursor][0] <= step:
            engine.add_request(arrivals[cursor][1])
            cursor += 1
        out = engine.step(step * DT)
        for req_id, _ in out.scheduled.new_reqs:
            admitted[req_id] = step * DT
        step += 1
        assert step < 100_000
    out_times = {}
    for step_at, request in arrivals:
        earlier = sum(1 for s, r in arrivals if s <= step_at and r is not request)
        out_times[request.req_id] = (request.arrival_time, admitted[request.req_id], earlier)
    return out_times


def _request(
    req_id: str, step: int, session: str, length: int, output: int, unique: int
) -> Request:
    base = 10_000 * unique  # distinct prompts: no prefix hits
    return Request(
        req_id=req_id,
        prompt_token_ids=tuple(range(base, base + length)),
        sampling=SamplingParams(max_tokens=output, ignore_eos=True),
        arrival_time=step * DT,
        session_id=session,
    )


@SETTINGS
@given(trace=turns, mode=st.sampled_from(["plas", "fcfs"]), heavy=st.integers(0, 4))
def test_every_waiting_turn_is_admitted_within_the_age_bound(
    trace: list[tuple[int, int, int, int]], mode: str, heavy: int
) -> None:
    max_wait_s = 0.2
    for req_id, (arrival, admitted, earlier) in run_trace(mode, max_wait_s, trace, heavy).items():
        bound = max_wait_s + ((earlier + 1) * SERVICE_STEPS + 1) * DT
        assert admitted - arrival <= bound + 1e-9, (req_id, admitted - arrival, bound)


def test_without_the_age_cap_plas_starves_a_heavy_session() -> None:
    """The bound above is not vacuous: with no effective cap the heavy turn waits out the flood."""
    trace = [(2, 0, 50, 2)]
    times = run_trace("plas", 1e9, trace, heavy=1)
    arrival, admitted, earlier = times["t0"]
    assert admitted - arrival > 0.2 + ((earlier + 1) * SERVICE_STEPS + 1) * DT
    capped = run_trace("plas", 0.2, trace, heavy=1)["t0"]
    assert capped[1] - capped[0] <= 0.2 + ((capped[2] + 1) * SERVICE_STEPS + 1) * DT
