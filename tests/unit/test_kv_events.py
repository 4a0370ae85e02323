"""KV events: what a hand-built cache emits matches what it registers, evicts and clears."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from hybridserve.core.config import SchedulerConfig
from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine import Engine
from hybridserve.engine.offline import run_to_completion
from hybridserve.kvcache import CacheLayout, FullAttentionSpec, KVCacheManager, MambaSpec
from hybridserve.kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheMirror,
    KVEvent,
    KVEventBatch,
    attach_events,
    batch_from_wire,
    batch_wire,
    wire,
)
from hybridserve.kvcache.hashing import cache_key
from hybridserve.scheduler import Scheduler
from hybridserve.sim.executor import SimulatedExecutor

BLOCK = 32


def _engine(num_blocks: int) -> tuple[Engine, Scheduler, KVCacheManager]:
    groups = (FullAttentionSpec(block_size=BLOCK), MambaSpec(block_size=BLOCK))
    cache = KVCacheManager(CacheLayout(groups=groups, num_blocks=num_blocks))
    scheduler = Scheduler(SchedulerConfig(max_model_len=4_096), cache)
    return Engine(scheduler, SimulatedExecutor(lambda plan: 0.01, seed=0)), scheduler, cache


def _serve(engine: Engine, req_id: str, prompt: list[int]) -> None:
    request = Request(
        req_id=req_id,
        prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(max_tokens=1, ignore_eos=True),
    )
    run_to_completion(engine, [request])


def _pool_keys(cache: KVCacheManager) -> Counter[bytes]:
    return Counter(b.key for b in cache.pool.blocks if b.key is not None)


def _recording(cache: KVCacheManager, scheduler: Scheduler) -> list[KVEvent]:
    events: list[KVEvent] = []
    attach_events(cache, events.append, tokens_of=lambda r: scheduler.requests[r].token_ids)
    return events


def test_block_stored_events_name_every_registration_with_its_group_parent_and_tokens() -> None:
    engine, scheduler, cache = _engine(num_blocks=512)
    events = _recording(cache, scheduler)
    prompt = list(range(1_000, 1_000 + 10 * BLOCK + 5))
    _serve(engine, "a", prompt)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert not [e for e in events if not isinstance(e, BlockStored)]  # nothing evicted
    # One event per registered block, under the key the pool holds, in the right group.
    assert Counter(cache_key(e.block_hashes[0], e.group_id) for e in stored) == _pool_keys(cache)
    per_group = Counter(e.group_id for e in stored)
    assert [per_group[g] for g in range(2)] == cache.registered_blocks()
    assert {e.group_kind for e in stored} == {"full", "mamba"}
    hashes = cache.hasher.hash_tokens(prompt)
    full = [e for e in stored if e.group_id == 0]
    assert [e.block_hashes[0] for e in full] == hashes[: len(full)]
    # Chained: each full-attention block's parent is the block before; the first has none.
    assert [e.parent_block_hash for e in full] == [None, *hashes[: len(full) - 1]]
    for index, event in enumerate(full):
        assert event.block_size == BLOCK
        assert event.token_ids == tuple(prompt[index * BLOCK : (index + 1) * BLOCK])
    # A state block names the prefix it ends: its parent is the block before it in the chain.
    for event in (e for e in stored if e.group_id == 1):
        index = hashes.index(event.block_hashes[0])
        assert event.parent_block_hash == (hashes[index - 1] if index else None)


def test_evictions_emit_block_removed_and_a_mirror_of_the_events_equals_the_pool() -> None:
    engine, scheduler, cache = _engine(num_blocks=40)  # room for about one prompt at a time
    events = _recording(cache, scheduler)
    mirror = CacheMirror.of(cache)
    for n in range(6):
        _serve(engine, f"r{n}", list(range(10_000 * (n + 1), 10_000 * (n + 1) + 20 * BLOCK)))
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed, "the pool was too large to evict"
    per_group = Counter(e.group_id for e in removed)
    assert [per_group[g] for g in range(2)] == cache.evicted_blocks()
    stored = Counter(
        cache_key(e.block_hashes[0], e.group_id) for e in events if isinstance(e, BlockStored)
    )
    stored.subtract(cache_key(e.block_hashes[0], e.group_id) for e in removed)
    assert +stored == _pool_keys(cache)
    assert mirror.counts() == dict(_pool_keys(cache))
    assert mirror.num_cached(0) + mirror.num_cached(1) == sum(_pool_keys(cache).values())


def test_the_mirror_answers_every_lookup_as_the_cache_does() -> None:
    engine, _, cache = _engine(num_blocks=48)
    mirror = CacheMirror.of(cache)
    shared = list(range(1_000, 1_000 + 12 * BLOCK))
    prompts = [
        [*shared, *range(2_000 + 100 * n, 2_000 + 100 * n + 3 * BLOCK * (n % 3))] for n in range(8)
    ]
    for n, prompt in enumerate(prompts):
        _serve(engine, f"r{n}", prompt)
        for probe in prompts:
            probe = [*probe, 7]
            hashes = cache.hasher.hash_tokens(probe)
            real, mirrored = (
                cache.find_hit(hashes, len(probe)),
                mirror.cache.find_hit(hashes, len(probe)),
            )
            assert (mirrored.num_tokens, mirrored.junction) == (real.num_tokens, real.junction)
    assert any(cache.find_hit(cache.hasher.hash_tokens(p), len(p) + 1).num_tokens for p in prompts)


def test_reset_clears_every_registration_with_one_event_and_is_refused_while_blocks_are_held() -> (
    None
):
    engine, scheduler, cache = _engine(num_blocks=512)
    events = _recording(cache, scheduler)
    mirror = CacheMirror.of(cache)
    _serve(engine, "a", list(range(1_000, 1_000 + 8 * BLOCK)))
    held = cache.pool.allocate(1)
    assert not cache.pool.reset_prefix_cache()  # a block is held: nothing changes
    assert not any(isinstance(e, AllBlocksCleared) for e in events)
    cache.pool.free(held)
    before = len(events)
    assert cache.pool.reset_prefix_cache()
    assert events[before:] == [AllBlocksCleared()]
    assert not _pool_keys(cache) and mirror.counts() == {}
    cache.pool.check_invariants()
    cache.check_invariants()


def test_a_cache_without_a_sink_emits_nothing_and_a_second_sink_gets_the_same_events() -> None:
    engine, _, cache = _engine(num_blocks=512)
    assert cache.pool.events is None
    _serve(engine, "a", list(range(100, 100 + 4 * BLOCK)))
    first: list[KVEvent] = []
    second: list[KVEvent] = []
    attach_events(cache, first.append)
    attach_events(cache, second.append)
    _serve(engine, "b", list(range(5_000, 5_000 + 4 * BLOCK)))
    assert first and first == second
    assert all(e.token_ids == () for e in first if isinstance(e, BlockStored))  # no token source


def test_wire_is_vllms_tagged_array_and_decodes_back() -> None:
    stored = BlockStored((b"\x01" * 32,), None, (1, 2), 2, group_id=1, group_kind="mamba")
    assert wire(stored) == [
        "BlockStored",
        [b"\x01" * 32],
        None,
        [1, 2],
        2,
        None,  # lora_id
        "GPU",  # medium
        None,  # lora_name
        None,  # extra_keys
        1,  # group_id, vLLM's group_idx
        "mamba",
    ]
    assert wire(BlockRemoved((b"\x02",), group_id=3)) == ["BlockRemoved", [b"\x02"], "GPU", 3]
    assert wire(AllBlocksCleared()) == ["AllBlocksCleared"]
    batch = KVEventBatch(1.5, (stored, BlockRemoved((b"\x02",)), AllBlocksCleared()))
    assert batch_wire(batch)[0] == 1.5
    assert batch_from_wire(batch_wire(batch)) == batch
    # vLLM's six-field BlockStored (no group): the rest take their defaults.
    old = batch_from_wire([0.0, [["BlockStored", [b"\x03"], None, [], 16, None, "GPU"]]])
    assert old.events == (BlockStored((b"\x03",), None, (), 16),)


@pytest.mark.parametrize(
    "module",
    ["hybridserve.kvcache.events", "hybridserve.sim.run", "hybridserve.server.kv_events"],
)
def test_the_event_types_and_the_simulator_import_without_zmq_or_msgpack(module: str) -> None:
    code = f"import sys, {module}; print(sorted({{'zmq', 'msgpack'}} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
