"""The host tier's own rules (HostTier), and what the simulated host link charges for them."""

from __future__ import annotations

from typing import Any

import pytest

from hybridserve.core.config import SchedulerConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import HostCopy, StepPlan, StepResult
from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine import Engine, StepFailed
from hybridserve.kvcache import CacheLayout, FullAttentionSpec, KVCacheManager
from hybridserve.kvcache.block_pool import Block
from hybridserve.kvcache.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    attach_events,
)
from hybridserve.kvcache.host_tier import HostTier
from hybridserve.scheduler import Scheduler
from hybridserve.sim.gpus import get_gpu
from hybridserve.sim.host_link import HOST_LINK_EFFICIENCY, HostLink, host_blocks
from tests.property.test_host_tier import ShadowExecutor


def _block(block_id: int, key: bytes, group_id: int = 0) -> Block:
    block = Block(block_id)
    block.key, block.group_id = key, group_id
    return block


def test_an_evicted_block_is_saved_before_the_step_and_its_slot_waits_a_step_after_a_load() -> None:
    tier = HostTier(1)
    tier.save(_block(5, b"a"))
    saves, loads = tier.take_transfers()
    assert saves == (HostCopy(0, 5, 0),) and loads == ()
    found = tier.lookup(b"a")
    assert found is not None
    tier.load(found, _block(7, b"a"))
    tier.save(_block(6, b"b"))  # the only slot is being read: nothing to drop, nothing saved
    assert tier.stats.refused == 1 and tier.lookup(b"b") is None
    saves, loads = tier.take_transfers()
    assert saves == () and loads == (HostCopy(0, 7, 0),)
    tier.save(_block(6, b"b"))  # the load has run: the slot is free again
    assert tier.take_transfers()[0] == (HostCopy(0, 6, 0),)
    tier.check_invariants()


def test_a_dropped_keys_save_never_lands_after_the_slot_is_reused() -> None:
    tier = HostTier(1, write_through=True)
    tier.save(_block(3, b"old"), computed=False)  # written through: runs after its forward
    tier.take_transfers()  # the step that computes block 3
    tier.save(_block(4, b"new"))  # evicted now: drops `old`, whose copy has not run yet
    saves, _ = tier.take_transfers()
    assert saves == (HostCopy(0, 4, 0),)


def test_a_write_through_key_a_queued_load_reads_is_not_dropped() -> None:
    tier = HostTier(2, write_through=True, loads_per_step=1)
    for block_id, key in ((1, b"x"), (2, b"y")):
        tier.save(_block(block_id, key))
    tier.take_transfers()
    for device, key in ((8, b"x"), (9, b"y")):
        found = tier.lookup(key)
        assert found is not None
        tier.load(found, _block(device, key), prefetch=True)
    tier.take_transfers()  # carries x's load; y's waits for the next step
    tier.save(_block(8, b"x"))  # x is stored again: y is now the least recent key
    tier.save(_block(3, b"z"))  # full: the key to drop is x, never y (a load still reads it)
    assert tier.lookup(b"y") is not None and tier.lookup(b"x") is None
    _, loads = tier.take_transfers()
    assert loads == (HostCopy(0, 9, 1, background=True),)
    assert tier.is_loading(9)
    tier.new_step()
    assert not tier.is_loading(9)


def test_a_background_save_of_a_block_evicted_in_its_step_runs_before_the_forward() -> None:
    tier = HostTier(4, write_through=True)
    block = _block(3, b"k")
    tier.save(block, computed=False)
    tier.take_transfers()
    tier.save(block)  # evicted while its write-through copy is still to run
    saves, _ = tier.take_transfers()
    assert saves == (HostCopy(0, 3, 0, background=False),)


def test_the_host_link_charges_latency_plus_bytes_over_the_measured_rate() -> None:
    h200 = get_gpu("H200")
    link = HostLink.of(h200, bytes_per_block=10e6)
    assert h200.host_link_bytes_per_s == 64e9  # PCIe Gen5 x16, one direction
    assert link.copy_s(0) == 0.0
    expected = 10e-6 + 8 * 10e6 / (64e9 * HOST_LINK_EFFICIENCY)
    assert link.copy_s(8) == pytest.approx(expected)
    assert get_gpu("A100-80G").host_link_bytes_per_s == 32e9  # PCIe Gen4


def test_a_step_pays_for_blocking_copies_and_for_what_outlasts_its_forward() -> None:
    link = HostLink(64e9, 10e-6, 10e6)
    saves = (HostCopy(0, 1, 0), HostCopy(0, 2, 1, background=True))
    loads = tuple(HostCopy(0, 3 + i, 2 + i, background=True) for i in range(40))
    plan = StepPlan(step_id=0, chunks=(), host_saves=saves, host_loads=loads)
    blocking = link.copy_s(1)
    beside = link.copy_s(40)
    assert link.step_s(plan, compute_s=0.0) == pytest.approx(blocking + beside)
    assert link.step_s(plan, compute_s=beside) == pytest.approx(blocking)
    assert link.step_s(StepPlan(step_id=1, chunks=()), compute_s=0.01) == 0.0


def test_host_memory_is_shared_by_the_tp_ranks_and_sized_in_blocks() -> None:
    gib = float(1 << 30)
    assert host_blocks(0, 1e6) == 0
    assert host_blocks(2, gib / 4) == 8
    assert host_blocks(2, gib / 4, tp=2) == 4
    with pytest.raises(ConfigError, match="host_memory_gib"):
        host_blocks(0.001, gib)
    with pytest.raises(ConfigError, match="host_memory_gib"):
        host_blocks(-1, gib)


# ----- the tier in an engine: prefetches and their lifecycle ----------------------------------


def _engine(
    *, num_blocks: int = 12, loads_per_step: int = 1, write_through: bool = False
) -> tuple[KVCacheManager, Scheduler, ShadowExecutor, Engine]:
    layout = CacheLayout(
        groups=(FullAttentionSpec(block_size=4),),
        num_blocks=num_blocks,
        host_blocks=16,
        host_write_through=write_through,
        host_loads_per_step=loads_per_step,
    )
    cache = KVCacheManager(layout)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), cache)
    shadow = ShadowExecutor(cache)
    return cache, scheduler, shadow, Engine(scheduler, shadow)


def _request(req_id: str, tokens: list[int], max_tokens: int = 1) -> Request:
    return Request(
        req_id=req_id,
        prompt_token_ids=tuple(tokens),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def _drain(engine: Engine) -> None:
    for _ in range(100):
        if not engine.has_requests():
            return
        engine.step()
    raise AssertionError("the engine did not drain")


PREFIX = list(range(100, 117))  # four full blocks of 4 tokens


def _evicted_prefix(**options: Any) -> tuple[KVCacheManager, Scheduler, ShadowExecutor, Engine]:
    """An engine whose host holds PREFIX's blocks: a request on it, then one that evicts it."""
    cache, scheduler, shadow, engine = _engine(**options)
    engine.add_request(_request("a", PREFIX))
    _drain(engine)
    size = 4 * (cache.layout.num_blocks - 2) + 1  # every block but one: a's all go
    engine.add_request(_request("evictor", list(range(200, 200 + size))))
    _drain(engine)
    assert cache.host is not None and all(
        cache.host.lookup(h + cache.groups[0].key_suffix) is not None
        for h in cache.hasher.hash_tokens(PREFIX)
    )
    return cache, scheduler, shadow, engine


def test_a_returning_prefix_is_prefetched_and_its_request_waits_for_the_loads() -> None:
    cache, _scheduler, shadow, engine = _evicted_prefix()
    engine.add_request(_request("b", [*PREFIX, 1, 2, 3]))
    first = engine.step()
    assert cache.is_prefetching("b") and not first.scheduled.new_reqs
    _drain(engine)
    snapshot = cache.metrics_snapshot()["host"]
    assert isinstance(snapshot, dict) and snapshot["hit_tokens"] == 16
    assert shadow.num_loads >= 4 and not cache._prefetch


def test_aborting_a_prefetching_waiter_releases_its_blocks() -> None:
    cache, _scheduler, _, engine = _evicted_prefix(loads_per_step=0)
    engine.add_request(_request("b", [*PREFIX, 1, 2, 3]))
    engine.step()
    assert cache.is_prefetching("b")
    engine.abort("b")
    assert not cache._prefetch
    assert all(b.ref_cnt == 0 for b in cache.pool.blocks[1:])
    cache.check_invariants()


def test_a_released_prefetch_takes_back_its_queued_loads() -> None:
    """A failed step lets the prefetch go while three of its four loads are still queued:
    those keys stay on the host, their device blocks leave the prefix cache, and the request
    is served right (the shadow executor checks every copy)."""
    cache, _scheduler, shadow, engine = _evicted_prefix(loads_per_step=1)
    real = shadow.execute
    failed: list[int] = []

    def execute(plan: StepPlan) -> StepResult:
        if plan.host_loads and not failed:
            failed.append(plan.step_id)
            raise RuntimeError("device lost")
        return real(plan)

    shadow.execute = execute  # type: ignore[method-assign]
    engine.add_request(_request("r", [*PREFIX, *range(500, 524)]))
    with pytest.raises(StepFailed):
        engine.step()
    host = cache.host
    assert host is not None and not host._queued and not cache._prefetch
    _drain(engine)
    cache.check_invariants()


def test_a_waiter_that_loses_the_head_lets_its_prefetch_go() -> None:
    """A request put back ahead of a prefetching waiter (as a preempted one is) needs every
    block: the waiter's prefetch must let go, or neither ever runs."""
    cache, scheduler, _, engine = _evicted_prefix(num_blocks=16, loads_per_step=1)
    engine.add_request(_request("b", [*PREFIX, 1, 2, 3]))
    engine.step()
    assert cache.is_prefetching("b")
    urgent = _request("urgent", list(range(700, 757)))  # 15 blocks of the 15 there are
    scheduler.waiting.prepend(urgent)
    scheduler.requests["urgent"] = urgent
    _drain(engine)
    cache.check_invariants()


def test_kv_events_name_the_host_tier_as_the_cpu_medium() -> None:
    cache, _, _, engine = _engine()
    events: list[object] = []
    attach_events(cache, events.append)
    engine.add_request(_request("a", PREFIX))
    _drain(engine)
    size = 4 * (cache.layout.num_blocks - 2) + 1
    engine.add_request(_request("evictor", list(range(200, 200 + size))))
    _drain(engine)
    cpu_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU]
    assert len(cpu_stored) >= 4
    events.clear()
    engine.add_request(_request("b", [*PREFIX, 1, 2, 3]))
    _drain(engine)
    assert any(isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU for e in events)
    gpu_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_GPU]
    assert {h for e in gpu_stored for h in e.block_hashes} >= set(cache.hasher.hash_tokens(PREFIX))
