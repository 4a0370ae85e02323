"""Every worked example of SPEC.md sections 1 to 4.2, named after the behaviour it pins."""

from __future__ import annotations

import pytest

from hybridserve.core.config import SpeculativeConfig
from hybridserve.kvcache import (
    CacheLayout,
    ChunkedLocalSpec,
    FullAttentionSpec,
    KVCacheManager,
    MambaSpec,
    Retention,
    SlidingWindowSpec,
)
from hybridserve.kvcache.block_pool import BlockPool
from hybridserve.kvcache.dcp import dcp_local_seq_lens
from hybridserve.kvcache.hashing import BlockHasher, cache_key, derived_hashes
from tests.conftest import prefill


def manager_for(
    *groups, speculation="none", num_blocks=64, retention="dense", **kw
) -> KVCacheManager:
    layout = CacheLayout(
        groups=tuple(groups),
        num_blocks=num_blocks,
        speculative=SpeculativeConfig.from_name(speculation),
        retention=Retention.parse(retention),
        **kw,
    )
    return KVCacheManager(layout)


def cache_blocks(manager: KVCacheManager, tokens: list[int], indices: set[int], gid: int) -> None:
    """Register exactly the blocks `indices` of group `gid` for `tokens` (test set-up)."""
    group = manager.groups[gid]
    hashes = derived_hashes(manager.hasher.hash_tokens(tokens), group.ctx.hash_ratio)
    for index in sorted(indices):
        block = manager.pool.allocate(1)[0]
        manager.pool.register(block, cache_key(hashes[index], gid), gid)
        manager.pool.free([block])


# ----- 1.1 hashing ------------------------------------------------------------------------------


def test_partial_block_gets_no_hash() -> None:
    hasher = BlockHasher(4)
    assert len(hasher.hash_tokens([11, 12, 13, 14, 15, 16, 17, 18, 19, 20])) == 2


def test_hash_chain_links_each_block_to_its_parent() -> None:
    hasher = BlockHasher(4)
    h0 = hasher.hash_block(None, (11, 12, 13, 14))
    h1 = hasher.hash_block(h0, (15, 16, 17, 18))
    assert hasher.hash_tokens([11, 12, 13, 14, 15, 16, 17, 18, 19, 20]) == [h0, h1]


def test_changing_a_token_changes_its_block_and_every_later_hash_only() -> None:
    hasher = BlockHasher(4)
    base = hasher.hash_tokens(list(range(16)))
    changed = hasher.hash_tokens([*range(4), 99, *range(5, 16)])
    assert changed[0] == base[0]
    assert all(a != b for a, b in zip(changed[1:], base[1:], strict=True))


def test_cache_salt_enters_block_zero_and_isolates_every_later_block() -> None:
    hasher = BlockHasher(4)
    tokens = [11, 12, 13, 14, 15, 16, 17, 18]
    plain = hasher.hash_tokens(tokens)
    salted = hasher.hash_tokens(tokens, cache_salt="t1")
    h0 = hasher.hash_block(None, tokens[:4], ("salt", "t1"))
    assert salted[0] == h0
    assert salted[1] == hasher.hash_block(h0, tokens[4:])
    assert all(a != b for a, b in zip(plain, salted, strict=True))


def test_cache_key_is_hash_then_group_id_big_endian() -> None:
    assert cache_key(b"\x01" * 32, 2) == b"\x01" * 32 + b"\x00\x00\x00\x02"
    assert cache_key(b"h", 0) != cache_key(b"h", 1)


def test_hashes_are_the_same_in_every_process() -> None:
    assert BlockHasher(2).hash_tokens([1, 2]) == BlockHasher(2).hash_tokens([1, 2])


def test_xxhash_is_an_alternative_digest() -> None:
    pytest.importorskip("xxhash")
    fast = BlockHasher(4, algo="xxh3_128").hash_tokens(list(range(8)))
    assert len(fast) == 2 and fast != BlockHasher(4).hash_tokens(list(range(8)))


# ----- 1.2 block pool ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uncached_to_head", "queue_after_finish"),
    [(False, [4, 5, 3, 2, 1]), (True, [3, 4, 5, 2, 1])],
)
def test_finished_request_frees_tail_first_and_allocation_evicts_one(
    uncached_to_head: bool, queue_after_finish: list[int]
) -> None:
    manager = manager_for(FullAttentionSpec(block_size=4), num_blocks=6)
    manager.pool.uncached_to_head = uncached_to_head
    a_tokens = list(range(10))
    prefill(manager, "A", a_tokens, chunk=10, free=False)
    assert manager.block_ids("A") == ((1, 2, 3),)
    manager.free("A")
    # Hashed blocks go to the tail deepest first; unhashed block 3 to the head when asked.
    assert manager.pool.free_queue.block_ids() == queue_after_finish
    b_tokens = [*a_tokens[:4], 50, 51, 52, 53, 54]
    hit = prefill(manager, "B", b_tokens, chunk=100, free=False)
    assert hit.num_tokens == 4
    assert manager.pool.num_evictions == 0
    c_hashes = manager.hasher.hash_tokens([70] * 8)
    manager.new_step()
    c_hit = manager.find_hit(c_hashes, 8)
    assert manager.allocate(
        "C",
        c_hashes,
        num_tokens=8,
        num_computed_tokens=0,
        num_new_tokens=8,
        hit=c_hit,
        num_prompt_tokens=8,
    )
    assert manager.pool.num_evictions == 1
    again = manager.find_hit(manager.hasher.hash_tokens(a_tokens[:8] + [1]), 9)
    assert again.num_tokens == 4
    manager.check_invariants()


def test_lookup_never_mutates_the_pool() -> None:
    manager = manager_for(FullAttentionSpec(block_size=4), num_blocks=16)
    tokens = list(range(12))
    prefill(manager, "A", tokens, chunk=12)
    before = (manager.pool.free_queue.block_ids(), [b.ref_cnt for b in manager.pool.blocks])
    manager.find_hit(manager.hasher.hash_tokens(tokens), len(tokens))
    after = (manager.pool.free_queue.block_ids(), [b.ref_cnt for b in manager.pool.blocks])
    assert before == after


def test_null_block_is_never_freed_or_handed_out() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.null_block not in blocks
    pool.free([pool.null_block, *blocks])
    assert pool.num_free_blocks == 3
    pool.check_invariants()


# ----- 1.3 registration -------------------------------------------------------------------------


def test_registration_stops_at_num_tokens_so_draft_slots_are_never_hashed() -> None:
    manager = manager_for(FullAttentionSpec(block_size=4), speculation="ngram", num_blocks=16)
    tokens = list(range(6))
    hashes = manager.hasher.hash_tokens(tokens)
    hit = manager.find_hit(hashes, 6)
    manager.allocate(
        "A",
        hashes,
        num_tokens=6,
        num_computed_tokens=0,
        num_new_tokens=6,
        num_lookahead_tokens=4,
        hit=hit,
        num_prompt_tokens=6,
    )
    assert manager.registered_blocks() == [1]
    assert len(manager.block_ids("A")[0]) == 3  # ceil(10 / 4) slots, only one full block hashed


def test_same_batch_request_hits_attention_block_registered_at_schedule_time() -> None:
    manager = manager_for(FullAttentionSpec(block_size=4), num_blocks=16)
    prefill(manager, "A", list(range(9)), chunk=9, free=False)
    hashes = manager.hasher.hash_tokens(list(range(8)) + [40, 41])
    assert manager.find_hit(hashes, 10).num_tokens == 8


def test_mamba_state_registered_this_step_waits_until_next_step() -> None:
    manager = manager_for(FullAttentionSpec(block_size=4), MambaSpec(block_size=4), num_blocks=32)
    tokens = list(range(9))
    hashes = manager.hasher.hash_tokens(tokens)
    manager.new_step()
    manager.allocate(  # this step's chunk [0, 8) materialises and registers the state at 8
        "A",
        hashes,
        num_tokens=9,
        num_computed_tokens=0,
        num_new_tokens=8,
        hit=manager.find_hit(hashes, 9),
        num_prompt_tokens=9,
    )
    follower = manager.hasher.hash_tokens(tokens[:8] + [50, 51])
    hit = manager.find_hit(follower, 10)
    assert hit.num_tokens == 8 and not hit.ready
    assert (
        manager.allocate(
            "B",
            follower,
            num_tokens=10,
            num_computed_tokens=0,
            num_new_tokens=2,
            hit=hit,
            num_prompt_tokens=10,
        )
        is None
    )
    manager.new_step()
    assert manager.find_hit(follower, 10).ready


def test_duplicate_registrations_coexist_and_either_serves_the_hit() -> None:
    manager = manager_for(FullAttentionSpec(block_size=4), num_blocks=16)
    tokens = list(range(8))
    prefill(manager, "A", tokens, chunk=8, free=False)
    hashes = manager.hasher.hash_tokens(tokens)
    manager.allocate(
        "B",
        hashes,
        num_tokens=8,
        num_computed_tokens=0,
        num_new_tokens=8,
        hit=manager._empty_hit(8, False),
        num_prompt_tokens=8,
    )
    assert manager.registered_blocks() == [4]
    assert manager.find_hit(hashes + [b"x"], 9).num_tokens == 8
    manager.check_invariants()


# ----- 1.4 / 1.5 units and the cap --------------------------------------------------------------


def test_derived_hashes_take_the_last_base_hash_of_each_unit() -> None:
    assert derived_hashes([b"A", b"B", b"C", b"D"], 2) == [b"B", b"D"]


@pytest.mark.parametrize(("prompt", "expected"), [(128, 96), (129, 128)])
def test_identical_resend_is_capped_one_token_short(prompt: int, expected: int) -> None:
    manager = manager_for(FullAttentionSpec(block_size=32), num_blocks=16)
    tokens = list(range(129))
    prefill(manager, "A", tokens, chunk=200)
    assert manager.find_hit(manager.hasher.hash_tokens(tokens[:prompt]), prompt).num_tokens == (
        expected
    )


# ----- 2.1 - 2.3 group rules ----------------------------------------------------------------------


def test_full_attention_hit_stops_at_first_miss_and_eagle_drops_a_unit() -> None:
    for speculation, expected in (("none", 64), ("eagle-legacy", 48)):
        manager = manager_for(FullAttentionSpec(block_size=16), speculation=speculation)
        tokens = list(range(100))
        cache_blocks(manager, tokens, {0, 1, 2, 3, 5}, gid=0)
        assert manager.find_hit(manager.hasher.hash_tokens(tokens), 100).num_tokens == expected


def test_sliding_window_takes_rightmost_run_and_nulls_the_rest() -> None:
    manager = manager_for(SlidingWindowSpec(block_size=16, window=32))
    tokens = list(range(100))
    cache_blocks(manager, tokens, {0, 3, 4}, gid=0)
    hit = manager.find_hit(manager.hasher.hash_tokens(tokens), 100)
    assert hit.num_tokens == 80
    null = manager.pool.null_block
    assert [b is null for b in hit.group_blocks[0]] == [True, True, True, False, False]


def test_sliding_window_under_eagle_needs_one_more_block_and_falls_to_zero() -> None:
    manager = manager_for(SlidingWindowSpec(block_size=16, window=32), speculation="eagle-legacy")
    tokens = list(range(100))
    cache_blocks(manager, tokens, {0, 3, 4}, gid=0)
    assert manager.find_hit(manager.hasher.hash_tokens(tokens), 100).num_tokens == 0


def test_chunked_local_counts_earlier_chunks_as_computed() -> None:
    manager = manager_for(ChunkedLocalSpec(block_size=4, chunk=8))
    tokens = list(range(16))
    cache_blocks(manager, tokens, {2}, gid=0)
    hit = manager.find_hit(manager.hasher.hash_tokens(tokens), 16)
    assert hit.num_tokens == 12
    null = manager.pool.null_block
    assert [b is null for b in hit.group_blocks[0]] == [True, True, False]


def test_mamba_hit_is_the_highest_aligned_state_with_nulls_before_it() -> None:
    manager = manager_for(
        FullAttentionSpec(block_size=32), MambaSpec(block_size=16), alignment_tokens=32
    )
    tokens = list(range(100))
    cache_blocks(manager, tokens, {0, 1, 2}, gid=0)
    cache_blocks(manager, tokens, {0, 2, 4}, gid=1)  # states at 16, 48, 80: none on the 32 grid
    assert manager.find_hit(manager.hasher.hash_tokens(tokens), 100).num_tokens == 0
    cache_blocks(manager, tokens, {3}, gid=1)  # state at 64
    hit = manager.find_hit(manager.hasher.hash_tokens(tokens), 100)
    assert hit.num_tokens == 64
    assert sum(b is not manager.pool.null_block for b in hit.group_blocks[1]) == 1


def test_align_mode_materialises_states_only_where_chunks_end() -> None:
    manager = manager_for(FullAttentionSpec(block_size=4), MambaSpec(block_size=4), num_blocks=64)
    tokens = list(range(20))
    # Chunks end at 12, at the checkpoint 16 (the replay boundary) and at 20.
    prefill(manager, "A", tokens, chunk=12)
    hashes = manager.hasher.hash_tokens(tokens + [99])
    manager.new_step()
    assert manager.find_hit(hashes, 21).num_tokens == 20
    assert manager.find_hit(hashes[:4] + [b"?"], 21).num_tokens == 16
    assert manager.find_hit(hashes[:3] + [b"?"], 21).num_tokens == 12
    assert manager.find_hit(hashes[:2] + [b"?"], 21).num_tokens == 0  # no chunk ended at 8


# ----- 3.1 / 3.3 reconciliation -------------------------------------------------------------------


def three_group_manager(speculation: str) -> tuple[KVCacheManager, list[int]]:
    manager = manager_for(
        FullAttentionSpec(block_size=16),
        SlidingWindowSpec(block_size=16, window=32),
        MambaSpec(block_size=16),
        speculation=speculation,
        num_blocks=128,
    )
    return manager, list(range(200))


def test_fixed_point_lowers_to_the_length_every_group_serves() -> None:
    manager, tokens = three_group_manager("none")
    cache_blocks(manager, tokens, set(range(6)), gid=0)  # full attention: 96
    cache_blocks(manager, tokens, {2, 3, 4}, gid=1)  # window run ending at 80 and at 64
    cache_blocks(manager, tokens, {3}, gid=2)  # state at 64
    hit = manager.find_hit(manager.hasher.hash_tokens(tokens[:100]), 100)
    assert hit.num_tokens == 64
    assert hit.sample is not None and hit.sample.group_offered_tokens == (96, 80, 64)
    assert hit.sample.limiting_group == 2


def test_eagle_three_group_hit_is_one_unit_below_not_a_spiral_to_zero() -> None:
    manager, tokens = three_group_manager("eagle-legacy")
    cache_blocks(manager, tokens, set(range(11)), gid=0)  # full attention matches 176
    cache_blocks(manager, tokens, set(range(11)), gid=1)
    cache_blocks(manager, tokens, set(range(11)), gid=2)
    hit = manager.find_hit(manager.hasher.hash_tokens(tokens[:170]), 170)
    assert hit.num_tokens == 144  # M = 160 after the cap, minus one A


# ----- 4.1 / 4.2 DCP geometry -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "interleave", "expected"),
    [(10, 1, [3, 3, 2, 2]), (2, 1, [1, 1, 0, 0]), (40, 16, [16, 16, 8, 0])],
)
def test_dcp_local_lengths_follow_the_interleave(
    length: int, interleave: int, expected: list[int]
) -> None:
    assert dcp_local_seq_lens(length, world_size=4, interleave=interleave) == expected


def test_dcp_widens_only_full_attention_units() -> None:
    layout = CacheLayout(
        groups=(FullAttentionSpec(block_size=64), MambaSpec(block_size=256)),
        num_blocks=16,
        dcp=4,
    )
    assert layout.units == (256, 256)
    assert layout.hash_block_size == 256 and layout.page_tokens == 256
