"""Whatever the pool, every request ends: it finishes, or the engine refuses it because its
blocks could never fit, and nothing it held stays allocated. A pool smaller than one long
request (which vLLM refuses at start-up) must not hold the queue for good."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridserve.core.config import SchedulerConfig
from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine import Engine
from hybridserve.executor.fake import FakeExecutor
from hybridserve.kvcache import CacheLayout, FullAttentionSpec, KVCacheManager, SlidingWindowSpec
from hybridserve.scheduler import Scheduler


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(6, 40),
    windows=st.integers(0, 3),
    budget=st.sampled_from((16, 64, 512)),
    prompts=st.lists(st.tuples(st.integers(1, 400), st.integers(1, 5)), min_size=1, max_size=8),
)
def test_every_request_finishes_or_is_refused_and_no_block_leaks(
    num_blocks: int, windows: int, budget: int, prompts: list[tuple[int, int]]
) -> None:
    groups = (
        FullAttentionSpec(block_size=8),
        *(SlidingWindowSpec(block_size=8, window=16) for _ in range(windows)),
    )
    cache = KVCacheManager(CacheLayout(groups=groups, num_blocks=num_blocks))
    config = SchedulerConfig(max_num_batched_tokens=budget, max_model_len=1024)
    engine = Engine(Scheduler(config, cache), FakeExecutor(lambda req_id, t: 7 + t))
    for n, (length, answer) in enumerate(prompts):
        engine.add_request(
            Request(
                req_id=f"r{n}",
                prompt_token_ids=tuple(range(n * 1000, n * 1000 + length)),
                sampling=SamplingParams(max_tokens=answer, ignore_eos=True),
            )
        )
    finished: set[str] = set()
    refused: set[str] = set()
    for _ in range(5_000):
        if not engine.has_requests():
            break
        step = engine.step()
        finished.update(out.req_id for out in step.outputs if out.finished)
        refused.update(failure.req_id for failure in step.failed)
        cache.check_invariants()
    assert not engine.has_requests(), "the engine did not drain"
    assert finished | refused == {f"r{n}" for n in range(len(prompts))}
    assert not finished & refused
    assert cache.num_free_blocks == cache.usable_blocks
