"""Cache metrics: staged at lookup, committed once at admission, bounded labels."""

from __future__ import annotations

from hybridserve.core.config import SpeculativeConfig
from hybridserve.kvcache import CacheLayout, FullAttentionSpec, KVCacheManager, MambaSpec
from tests.conftest import prefill


def small_manager(num_blocks: int = 8, speculation: str = "none") -> KVCacheManager:
    return KVCacheManager(
        CacheLayout(
            groups=(FullAttentionSpec(block_size=4), MambaSpec(block_size=4)),
            num_blocks=num_blocks,
            speculative=SpeculativeConfig.from_name(speculation),
        )
    )


def test_waiter_that_fails_allocation_k_times_counts_once_at_admission() -> None:
    manager = small_manager(num_blocks=8)
    prefill(manager, "hog", list(range(20)), chunk=20, free=False)  # holds most of the pool
    tokens = list(range(100, 120))
    hashes = manager.hasher.hash_tokens(tokens)
    for _ in range(3):
        manager.new_step()
        hit = manager.find_hit(hashes, len(tokens))
        assert (
            manager.allocate(
                "late",
                hashes,
                num_tokens=20,
                num_computed_tokens=0,
                num_new_tokens=20,
                hit=hit,
                num_prompt_tokens=20,
                full_sequence_must_fit=True,
            )
            is None
        )
    assert manager.metrics.requests == 1 and manager.metrics.queried_tokens == 20
    manager.free("hog")
    manager.new_step()
    hit = manager.find_hit(hashes, len(tokens))
    assert manager.allocate(
        "late",
        hashes,
        num_tokens=20,
        num_computed_tokens=0,
        num_new_tokens=20,
        hit=hit,
        num_prompt_tokens=20,
        full_sequence_must_fit=True,
    )
    assert manager.metrics.requests == 2 and manager.metrics.queried_tokens == 40


def test_resumed_requests_are_recorded_apart_from_the_hit_rate() -> None:
    manager = small_manager(num_blocks=32)
    tokens = list(range(12))
    prefill(manager, "a", tokens, chunk=12)
    hashes = manager.hasher.hash_tokens(tokens)
    manager.new_step()
    hit = manager.find_hit(hashes, 12, resumed=True)
    manager.allocate(
        "a",
        hashes,
        num_tokens=12,
        num_computed_tokens=0,
        num_new_tokens=12 - hit.num_tokens,
        hit=hit,
        num_prompt_tokens=12,
    )
    assert manager.metrics.requests == 1
    assert manager.metrics.preempted_requests == 1
    assert manager.metrics.preempted_hit_tokens == hit.num_tokens > 0


def test_cacheable_tokens_separates_short_prompts_from_a_broken_cache() -> None:
    manager = small_manager(speculation="eagle-legacy")
    assert manager.cacheable_tokens(4) == 0  # shorter than one unit plus the drop
    assert manager.cacheable_tokens(13) == 8  # floor(12/4)*4 - 4


def test_prometheus_samples_use_the_namespace_and_only_group_labels() -> None:
    manager = small_manager(num_blocks=32)
    prefill(manager, "a", list(range(12)), chunk=12)
    samples = manager.metrics.samples(
        registered=manager.registered_blocks(), evicted=manager.evicted_blocks()
    )
    names = {name for name, _, _ in samples}
    assert "hybridserve:prefix_cache_queries_total" in names
    assert "hybridserve:hybrid_group_hit_tokens_total" in names
    for name, labels, _ in samples:
        assert name.startswith("hybridserve:") and name.endswith("_total")
        assert set(labels) <= {"group", "kind"}
    label_sets = {tuple(sorted(labels.items())) for _, labels, _ in samples}
    assert len(label_sets) <= 1 + len(manager.groups)


def test_lookups_do_not_touch_metrics_and_disabled_metrics_record_nothing() -> None:
    manager = small_manager(num_blocks=32)
    manager.find_hit(manager.hasher.hash_tokens(list(range(12))), 12)
    assert manager.metrics.requests == 0
    quiet = KVCacheManager(manager.layout, enable_metrics=False)
    prefill(quiet, "a", list(range(12)), chunk=12)
    assert quiet.metrics.requests == 0
    assert quiet.registered_blocks()[0] == 3


def test_snapshot_reports_registrations_and_evictions_per_group() -> None:
    manager = small_manager(num_blocks=8)
    prefill(manager, "a", list(range(12)), chunk=12)
    prefill(manager, "b", list(range(50, 62)), chunk=12)
    snapshot = manager.metrics_snapshot()
    groups = snapshot["groups"]
    assert isinstance(groups, list)
    assert [g["kind"] for g in groups] == ["full", "mamba"]
    assert groups[0]["registered_blocks"] == 6
    assert sum(g["evicted_blocks"] for g in groups) > 0
