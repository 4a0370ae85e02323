"""Tokens received from another engine (a prefill/decode handoff, vLLM's KV connector): admission
marks them computed at once, the step schedules only what follows, and the cache ends as if the
request had prefilled them here in one chunk."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.core.errors import RequestError
from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine import Engine
from tests.conftest import fake_executor, make_scheduler

PROMPT = tuple(range(1_000))


def _handoff(
    req_id: str = "h", *, external: int = 999, prompt: tuple[int, ...] = PROMPT
) -> Request:
    return Request(
        req_id=req_id,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=4, ignore_eos=True),
        num_external_computed_tokens=external,
    )


def _engine(*, mamba: bool = False, budget: int = 256) -> Engine:
    return Engine(make_scheduler(mamba=mamba, max_num_batched_tokens=budget), fake_executor())


def test_received_tokens_are_computed_at_once_and_only_the_rest_is_scheduled() -> None:
    engine = _engine(budget=256)  # far below the 1,000-token prompt
    engine.add_request(_handoff())
    step = engine.step()
    assert dict(step.scheduled.num_scheduled_tokens) == {"h": 1}
    assert step.scheduled.new_reqs == (("h", 0),)  # the local prefix hit: received is no hit
    request = engine.scheduler.requests["h"]
    assert request.num_computed_tokens == 1_000
    assert request.num_external_computed_tokens == 0  # consumed at admission
    assert len(request.output_token_ids) == 1  # the first step already samples
    (table,) = engine.scheduler.cache.block_ids("h")
    assert len(table) == -(-1_001 // 16)  # every token has its slot, and the next one's


@pytest.mark.parametrize("mamba", [False, True])
def test_the_cache_ends_as_after_the_prefill_the_sender_ran(mamba: bool) -> None:
    """The reference prefills the 1,000 tokens here, as the prefill replica did: one chunk, or
    with the state group two (the align-mode scheduler ends one at the kept state, 992)."""
    received = _engine(mamba=mamba)
    computed = _engine(mamba=mamba, budget=2_048)
    received.add_request(_handoff())
    computed.add_request(_handoff(external=0))
    assert dict(received.step().scheduled.num_scheduled_tokens) == {"h": 1}
    chunks = []
    while computed.scheduler.requests["h"].num_computed_tokens < 1_000:
        chunks.append(dict(computed.step().scheduled.num_scheduled_tokens)["h"])
    assert chunks == ([992, 8] if mamba else [1_000])
    a, b = received.scheduler.cache, computed.scheduler.cache
    # The same blocks held per group (ids may differ: the pool hands them out in another order).
    assert [len(t) for t in a.block_ids("h")] == [len(t) for t in b.block_ids("h")]
    assert a.registered_blocks() == b.registered_blocks() == ([62, 1] if mamba else [62])
    assert a.num_free_blocks == b.num_free_blocks
    a.check_invariants()
    # A later request that extends the prompt hits the received blocks as it would hit computed
    # ones: every full block, and with the state group the kept state at 992.
    follow = (*PROMPT, *range(5_000, 5_500))
    hashes = a.hasher.hash_tokens(follow)
    hits = [c.find_hit(hashes, len(follow)).num_tokens for c in (a, b)]
    assert hits == [992, 992]


def test_a_local_hit_past_the_received_tokens_wins() -> None:
    engine = _engine(budget=2_048)
    engine.add_request(_handoff("first", external=0))
    while engine.scheduler.has_requests():
        engine.step()
    engine.add_request(_handoff("second", external=100))
    step = engine.step()
    # The local hit (992 tokens) is past the 100 received: the step computes the last 8.
    assert step.scheduled.new_reqs == (("second", 992),)
    assert dict(step.scheduled.num_scheduled_tokens) == {"second": 8}


@pytest.mark.parametrize("bad", [-1, 1_000, 5_000, True, 2.5])
def test_received_tokens_outside_the_prompt_are_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(RequestError) as info:
        _handoff(external=bad)  # type: ignore[arg-type]
    assert info.value.field == "num_external_computed_tokens"
    assert "0 to 999" in str(info.value)


@settings(max_examples=40, deadline=None)
@given(
    prompt_len=st.integers(2, 2_500),
    share=st.floats(0.0, 1.0),
    received=st.floats(0.0, 1.0),
    mamba=st.booleans(),
    budget=st.sampled_from([64, 512, 4_096]),
)
def test_any_received_count_runs_to_the_end_with_the_cache_consistent_and_no_block_leaked(
    prompt_len: int, share: float, received: float, mamba: bool, budget: int
) -> None:
    """A request that shares part of its prompt with an earlier one and received some of it:
    its first step computes from the larger of its hit and the received tokens, every step
    leaves the cache consistent, and every block comes back at the end."""
    engine = _engine(mamba=mamba, budget=budget)
    cache = engine.scheduler.cache
    free_at_start = cache.num_free_blocks
    shared = int(prompt_len * share)
    engine.add_request(_handoff("earlier", external=0, prompt=tuple(range(max(shared, 1)))))
    while engine.scheduler.has_requests():
        engine.step()
    prompt = (*range(shared), *range(10_000, 10_000 + prompt_len - shared))
    external = min(int(prompt_len * received), prompt_len - 1)
    engine.add_request(_handoff("h", external=external, prompt=prompt))
    step = engine.step()
    ((_, hit),) = step.scheduled.new_reqs
    start = max(hit, external)
    scheduled = dict(step.scheduled.num_scheduled_tokens)["h"]
    # Within the budget; with the state group the align-mode scheduler may end it sooner.
    assert 0 < scheduled <= min(prompt_len - start, budget)
    assert mamba or scheduled == min(prompt_len - start, budget)
    assert engine.scheduler.requests["h"].num_computed_tokens == start + scheduled
    cache.check_invariants()
    while engine.scheduler.has_requests():
        engine.step()
        cache.check_invariants()
    assert cache.num_free_blocks == free_at_start
