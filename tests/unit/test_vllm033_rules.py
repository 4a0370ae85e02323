"""vLLM 0.33's cache and scheduler rules under speculation and hybrid layouts, one test each,
with the numbers measured on vLLM 0.33.0 itself (docs/vllm_baseline.md lists the rules)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridserve.core.config import SchedulerConfig, SchedulingPolicy, SpeculativeConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import StepPlan, StepResult
from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine import Engine
from hybridserve.executor.fake import FakeExecutor
from hybridserve.kvcache import (
    CacheLayout,
    FullAttentionSpec,
    KVCacheManager,
    MambaSpec,
    Retention,
    SlidingWindowSpec,
)
from hybridserve.kvcache.hashing import derived_hashes
from hybridserve.kvcache.spec import GroupSpec
from hybridserve.scheduler import Scheduler


class DraftingExecutor(FakeExecutor):
    """FakeExecutor that also proposes `num_drafts` draft tokens for every scheduled request."""

    def __init__(self, num_drafts: int) -> None:
        super().__init__(lambda req_id, t: 40_000 + t)
        self.num_drafts = num_drafts

    def execute(self, plan: StepPlan) -> StepResult:
        result = super().execute(plan)
        drafts = {c.req_id: (7,) * self.num_drafts for c in plan.chunks}
        return StepResult(result.step_id, result.sampled_token_ids, 0.0, drafts)


def build(
    groups: Sequence[GroupSpec],
    *,
    speculation: str = "none",
    drafts: int = 0,
    retention: str = "boundary",
    budget: int = 8192,
    num_blocks: int = 2000,
    max_in_flight_tokens: int = 0,
    caching: bool = True,
    executor: FakeExecutor | None = None,
) -> tuple[Engine, KVCacheManager]:
    layout = CacheLayout(
        groups=tuple(groups),
        num_blocks=num_blocks,
        speculative=SpeculativeConfig.from_name(
            speculation, drafts if speculation != "none" else 0
        ),
        retention=Retention.parse(retention),
        max_in_flight_tokens=max_in_flight_tokens,
    )
    cache = KVCacheManager(layout, enable_caching=caching)
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_model_len=65_536),
        cache,
        num_speculative_tokens=drafts,
    )
    return Engine(scheduler, executor or FakeExecutor(lambda req_id, t: 40_000 + t)), cache


def run(
    engine: Engine, req_id: str, tokens: Sequence[int], max_tokens: int = 1
) -> tuple[int, list[int]]:
    """Run one request to the end; returns its admission hit and its scheduled chunk sizes."""
    engine.add_request(
        Request(
            req_id=req_id,
            prompt_token_ids=tuple(tokens),
            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
    )
    hit, chunks = -1, []
    for _ in range(10_000):
        if not engine.has_requests():
            break
        done = engine.step()
        for rid, num in done.scheduled.new_reqs:
            if rid == req_id:
                hit = num
        chunks += [n for rid, n in done.scheduled.num_scheduled_tokens if rid == req_id]
    return hit, chunks


PROMPT = list(range(1_000, 5_000))


def test_lookahead_block_hashes_hit_the_resend_without_a_drop() -> None:
    # Rule 1: FA block 16, EAGLE, prime 48 tokens then resend: vLLM 0.33 hits 32.
    engine, _ = build([FullAttentionSpec(block_size=16)], speculation="eagle", drafts=1)
    run(engine, "prime", PROMPT[:48])
    assert run(engine, "resend", PROMPT[:48])[0] == 32


def test_legacy_drop_loses_the_last_block_of_the_resend() -> None:
    engine, _ = build([FullAttentionSpec(block_size=16)], speculation="eagle-legacy", drafts=1)
    run(engine, "prime", PROMPT[:48])
    assert run(engine, "resend", PROMPT[:48])[0] == 16


def test_a_block_hash_covers_its_lookahead_token() -> None:
    engine, cache = build([FullAttentionSpec(block_size=16)], speculation="mtp", drafts=2)
    assert cache.hasher.lookahead == 1
    assert len(cache.hasher.hash_tokens(PROMPT[:48])) == 2  # block 2 waits for token 48
    run(engine, "prime", PROMPT[:48])
    other = PROMPT[:32] + [9]  # same first two blocks, another token after them
    assert run(engine, "other", other + PROMPT[33:48])[0] == 16


def test_eagle_margin_reaches_past_the_cap_in_a_hybrid_coordinator() -> None:
    # Rule 2: FA16 + SWA(16, window 32), block-aligned 64-token resend: vLLM 48.
    groups = [FullAttentionSpec(block_size=16), SlidingWindowSpec(block_size=16, window=32)]
    engine, _ = build(groups, speculation="eagle-legacy", drafts=1)
    run(engine, "prime", PROMPT[:64])
    assert run(engine, "resend", PROMPT[:64])[0] == 48


def test_legacy_retention_keeps_where_the_dropped_lookup_lands() -> None:
    # Rules 2 and 3: FA32 + Mamba32, retention 0, a 128-token prompt: the resend hits 96.
    groups = [FullAttentionSpec(block_size=32), MambaSpec(block_size=32)]
    engine, _ = build(groups, speculation="eagle-legacy", drafts=1)
    run(engine, "prime", PROMPT[:128])
    assert run(engine, "resend", PROMPT[:128])[0] == 96


def test_the_shared_prefix_junction_is_the_match_after_the_drop() -> None:
    # Rule 4: FA16 + Mamba16, 48 primed, a 50-token sibling sharing 40: vLLM's
    # shared_prefix_boundary is 16 (the 32-token match less the dropped block), not 32.
    groups = [FullAttentionSpec(block_size=16), MambaSpec(block_size=16)]
    engine, cache = build(groups, speculation="eagle-legacy", drafts=1)
    run(engine, "prime", PROMPT[:48])
    sibling = PROMPT[:40] + list(range(9_000, 9_010))
    hit = cache.find_hit(cache.hasher.hash_tokens(sibling), len(sibling))
    assert hit.junction == 16


def test_registration_rounds_down_to_the_scheduler_block() -> None:
    # Rule 6: FA32 + SWA16 (dense), 112 tokens: vLLM caches SWA blocks 0..5, not 0..6.
    groups = [FullAttentionSpec(block_size=32), SlidingWindowSpec(block_size=16, window=64)]
    engine, cache = build(groups, retention="dense")
    run(engine, "prime", PROMPT[:112])
    assert cache.registered_blocks() == [3, 6]


def test_sliding_window_admission_counts_at_most_window_plus_in_flight() -> None:
    # Rule 7: FA16 + SWA(16, window 64), a 78-block pool, a 768-token prompt is admitted.
    groups = [FullAttentionSpec(block_size=16), SlidingWindowSpec(block_size=16, window=64)]
    engine, _ = build(groups, budget=256, num_blocks=78, max_in_flight_tokens=256)
    hit, chunks = run(engine, "long", PROMPT[:768])
    assert hit == 0 and sum(chunks) == 768
    uncapped, _ = build(groups, budget=256, num_blocks=78)
    uncapped.add_request(
        Request(
            req_id="long",
            prompt_token_ids=tuple(PROMPT[:768]),
            sampling=SamplingParams(max_tokens=1),
        )
    )
    assert uncapped.step().scheduled.num_scheduled_tokens == ()  # 96 blocks do not fit


def test_a_waiter_that_cannot_fit_an_empty_pool_is_refused_and_the_queue_goes_on() -> None:
    # vLLM refuses at start-up a pool that cannot hold max_model_len; here one can be smaller.
    # Without the refusal the 768-token prompt (96 blocks in a 78-block pool, whole-sequence
    # check) would hold the head of the queue for good, and the short prompt behind it too.
    groups = [FullAttentionSpec(block_size=16), SlidingWindowSpec(block_size=16, window=64)]
    engine, cache = build(groups, budget=256, num_blocks=78)
    for req_id, length in (("long", 768), ("short", 100)):
        engine.add_request(
            Request(
                req_id=req_id,
                prompt_token_ids=tuple(PROMPT[:length]),
                sampling=SamplingParams(max_tokens=2, ignore_eos=True),
            )
        )
    first = engine.step()
    assert [f.req_id for f in first.failed] == ["long"]
    assert "<768 tokens> cannot start" in first.failed[0].reason
    assert "77 blocks" in first.failed[0].reason
    assert dict(first.scheduled.num_scheduled_tokens) == {"short": 100}
    while engine.has_requests():
        engine.step()
    assert cache.num_free_blocks == cache.usable_blocks  # nothing leaked


def test_a_waiter_that_fits_once_the_running_ones_finish_is_not_refused() -> None:
    groups = [FullAttentionSpec(block_size=16)]
    engine, _ = build(groups, budget=256, num_blocks=30)
    for req_id, length in (("first", 300), ("second", 300)):  # 19 blocks each, 29 usable
        engine.add_request(
            Request(
                req_id=req_id,
                prompt_token_ids=tuple(PROMPT[:length]),
                sampling=SamplingParams(max_tokens=4, ignore_eos=True),
            )
        )
    seen = set()
    while engine.has_requests():
        step = engine.step()
        assert not step.failed
        seen.update(r for r, _ in step.scheduled.new_reqs)
    assert seen == {"first", "second"}


def test_mamba_split_ignores_dense_retention() -> None:
    # Rule 9: FA400 + Mamba400 with a prefill checkpoint, dense retention: 2,002 tokens, one chunk.
    groups = [FullAttentionSpec(block_size=400), MambaSpec(block_size=400, prefill_checkpoint=True)]
    engine, _ = build(groups, retention="dense")
    assert run(engine, "p", PROMPT[:2002])[1][0] == 2002


def test_prefill_checkpoint_stays_on_under_the_legacy_drop() -> None:
    # Rule 9: block 1600 with a checkpoint under EAGLE legacy: a 3,602-token prompt is one chunk.
    groups = [
        FullAttentionSpec(block_size=1600),
        MambaSpec(block_size=1600, prefill_checkpoint=True),
    ]
    engine, _ = build(groups, speculation="eagle-legacy", drafts=1, num_blocks=200)
    assert run(engine, "p", PROMPT[:3602])[1][0] == 3602


def test_drafts_of_a_request_still_prefilling_are_discarded() -> None:
    # Rule 10: 80-token prompt, budget 50, 3 drafts reported after the first chunk: then 30.
    engine, _ = build(
        [FullAttentionSpec(block_size=16)],
        speculation="ngram",
        drafts=3,
        budget=50,
        executor=DraftingExecutor(3),
    )
    assert run(engine, "p", PROMPT[:80], max_tokens=2)[1][:2] == [50, 30]


def test_no_prefix_cache_stats_with_caching_off() -> None:
    # Rule 11: vLLM records nothing when prefix caching is off.
    engine, cache = build([FullAttentionSpec(block_size=16)], caching=False)
    run(engine, "p", PROMPT[:64])
    snapshot = cache.metrics_snapshot()
    assert all(not value for key, value in snapshot.items() if "quer" in key), snapshot


def test_a_retention_interval_off_the_scheduler_block_is_rejected() -> None:
    # Rule 12.
    groups = (FullAttentionSpec(block_size=32), MambaSpec(block_size=32))
    with pytest.raises(ConfigError, match="multiple of the scheduler block 32"):
        CacheLayout(groups=groups, num_blocks=64, retention=Retention.parse("interval:48"))
    with pytest.raises(ConfigError, match="sliding-window or state group"):
        CacheLayout(
            groups=(FullAttentionSpec(block_size=16),),
            num_blocks=64,
            retention=Retention.parse("interval:64"),
        )


def test_scheduler_policy_given_by_name_is_coerced_never_dropped() -> None:
    # Rule 12: a string "priority" used to build an FCFS scheduler silently.
    assert SchedulerConfig(policy="priority").policy is SchedulingPolicy.PRIORITY  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"scheduler\.policy"):
        SchedulerConfig(policy="lifo")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"scheduler\.enable_chunked_prefill"):
        SchedulerConfig(enable_chunked_prefill="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"scheduler\.reserve_full_isl"):
        SchedulerConfig(reserve_full_isl=1)  # type: ignore[arg-type]


def test_legacy_spec_names_select_the_block_drop() -> None:
    assert SpeculativeConfig.from_name("mtp").drops_target_tail is False
    assert SpeculativeConfig.from_name("mtp").hash_lookahead_tokens == 1
    legacy = SpeculativeConfig.from_name("mtp-legacy", 2)
    assert legacy.drops_target_tail and legacy.hash_lookahead_tokens == 0
    assert legacy.name == "mtp-legacy"
    multi = SpeculativeConfig(
        method=SpeculativeConfig.from_name("mtp").method,
        num_speculative_tokens=3,
        multi_module_mtp=True,
    )
    assert multi.hash_lookahead_tokens == 3
    with pytest.raises(ConfigError, match="legacy form"):
        SpeculativeConfig.from_name("ngram-legacy")


# ----- closed forms of FORMAT.md 7.6 on random scenarios -------------------------------------

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    block=st.sampled_from([4, 8, 16]),
    first_len=st.integers(2, 120),
    shared=st.integers(0, 120),
    second_len=st.integers(2, 160),
    legacy=st.booleans(),
)
def test_full_attention_hits_follow_the_lookahead_and_legacy_closed_forms(
    block: int, first_len: int, shared: int, second_len: int, legacy: bool
) -> None:
    """A request sharing its first c tokens with a cached one hits floor((min(c, P) - 1)/H)*H
    with lookahead block hashes, and max(floor(min(c, P - 1)/H)*H - H, 0) on the legacy drop."""
    shared = min(shared, first_len, second_len)
    first = PROMPT[:first_len]
    second = first[:shared] + list(range(90_000, 90_000 + second_len - shared))
    engine, _ = build(
        [FullAttentionSpec(block_size=block)],
        speculation="eagle-legacy" if legacy else "eagle",
        drafts=1,
    )
    run(engine, "first", first)
    hit = run(engine, "second", second)[0]
    if legacy:
        expected = max(min(shared, second_len - 1) // block * block - block, 0)
    else:
        expected = max((min(shared, second_len) - 1) // block * block, 0)
    assert hit == expected


@SETTINGS
@given(
    block=st.sampled_from([8, 16, 32]),
    prompt_len=st.integers(2, 200),
    legacy=st.booleans(),
    checkpoint=st.booleans(),
)
def test_hybrid_resends_hit_the_recorded_closed_form(
    block: int, prompt_len: int, legacy: bool, checkpoint: bool
) -> None:
    """An identical resend on full attention + Mamba (align, retention 0): floor((P-1)/A)*A with
    lookahead hashes, one block less on the legacy path unless P is block-aligned (the margin
    then reaches the hashed length); states only where a chunk end or the checkpoint put them
    (without a checkpoint a block-aligned prompt is one chunk with no state at its boundary)."""
    groups = [
        FullAttentionSpec(block_size=block),
        MambaSpec(block_size=block, prefill_checkpoint=checkpoint),
    ]
    engine, _ = build(groups, speculation="eagle-legacy" if legacy else "eagle", drafts=1)
    prompt = PROMPT[:prompt_len]
    run(engine, "first", prompt)
    hit = run(engine, "resend", prompt)[0]
    base = (prompt_len - 1) // block * block
    if legacy and prompt_len % block:
        base -= block
    if not legacy and not checkpoint and prompt_len % block == 0:
        base = 0  # one chunk: its only state is at P, the boundary P - block never existed
    assert hit == max(base, 0)


def test_dense_sliding_window_registers_only_the_blocks_a_hit_can_use() -> None:
    # Rule 5: FA32 + SWA(block 8, window 8), dense, 64 tokens: vLLM caches SWA blocks 3 and 7.
    groups = [FullAttentionSpec(block_size=32), SlidingWindowSpec(block_size=8, window=8)]
    engine, cache = build(groups, retention="dense")
    run(engine, "prime", PROMPT[:64])
    swa = cache.groups[1]
    hashes = cache.hasher.hash_tokens(PROMPT[:64])
    cached = [i for i in range(8) if swa._cached(derived_hashes(hashes, swa.ctx.hash_ratio), i)]
    assert cached == [3, 7]
    # The resend still hits at the segment grid: 32 (cap 63, the window before 32 is block 3).
    assert run(engine, "resend", PROMPT[:64])[0] == 32


def test_fine_grained_hits_stop_at_the_tail_and_serve_it() -> None:
    # Rule 8: FA16 + Mamba544, hash 16, partial hits, a 1,249-token prompt: chunks
    # [1088, 160, 1] and an identical resend hits 1,248 (the partial tail).
    layout = CacheLayout(
        groups=(FullAttentionSpec(block_size=16), MambaSpec(block_size=544)),
        num_blocks=4000,
        hash_block_size=16,
        alignment_tokens=16,
        partial_hash_hits=True,
        retention=Retention.parse("boundary"),
    )
    cache = KVCacheManager(layout)
    scheduler = Scheduler(SchedulerConfig(max_model_len=65_536), cache)
    engine = Engine(scheduler, FakeExecutor(lambda req_id, t: 40_000 + t))
    hit, chunks = run(engine, "prime", PROMPT[:1249])
    assert (hit, chunks[:3]) == (0, [1088, 160, 1])
    assert run(engine, "resend", PROMPT[:1249])[0] == 1248


# The legacy EAGLE drop on a sliding window whose block (8) is smaller than the scheduler block
# (32): FA32 + SWA(block 8, window 8), hash block 8, a 100-block pool, every group an EAGLE
# group, token ids that repeat each value 8 times. "Cached" below means the SWA group's
# hash-block positions whose block is registered in the cache. Every number was measured on
# vLLM 0.33.0's own KVCacheManager (HybridKVCacheCoordinator, SlidingWindowManager) driven with
# the scheduler's calls for a one-chunk prefill.
EAGLE_FA32 = FullAttentionSpec(block_size=32)
EAGLE_SWA8 = SlidingWindowSpec(block_size=8, window=8)


def repeated_tokens(n: int) -> list[int]:
    return [i // 8 for i in range(n)]


def cached_window_positions(cache: KVCacheManager, tokens: Sequence[int], group: int) -> list[int]:
    swa = cache.groups[group]
    hashes = derived_hashes(cache.hasher.hash_tokens(tokens), swa.ctx.hash_ratio)
    return [i for i in range(len(hashes)) if swa._cached(hashes, i)]


def build_eagle_windows(retention: str, num_windows: int = 1) -> tuple[Engine, KVCacheManager]:
    groups = [EAGLE_FA32, *([EAGLE_SWA8] * num_windows)]
    return build(groups, speculation="eagle-legacy", drafts=1, num_blocks=100, retention=retention)


def test_dense_eagle_window_resend_hits_at_the_segment_grid() -> None:
    """128 tokens, then the same prompt (dense): vLLM 0.33 hits 96.

    The cap is 127; the hybrid coordinator asks full attention up to min(127 + 32, 16 hashes *
    8) = 128, it matches 4 blocks and drops one: 96. The window group is asked up to
    min(96 + 8, 128) = 104 and needs cdiv(8 - 1, 8) + 1 = 2 contiguous blocks: 11 and 12 are
    cached, so it matches 13 blocks and drops one, 96. Registration keeps, per 32-token
    segment, the window before the segment end and the block after it (the reachable mask
    shifted up one block): 3, 4, 7, 8, 11, 12 and 15 of the 16 full blocks.
    """
    engine, cache = build_eagle_windows("dense")
    run(engine, "prime", repeated_tokens(128))
    assert cached_window_positions(cache, repeated_tokens(128), 1) == [3, 4, 7, 8, 11, 12, 15]
    assert run(engine, "resend", repeated_tokens(128))[0] == 96


def test_dense_eagle_window_keeps_the_block_after_each_segment_end() -> None:
    """40 tokens (dense): vLLM 0.33 caches SWA positions 3 and 4 (the window before 32 and the
    block after it, the drop's proof: the cacheable length is 32 plus one SWA block); a 41-token
    follow-up hits 0 (full attention, asked up to the hashed 40 tokens, matches one block and
    drops it)."""
    engine, cache = build_eagle_windows("dense")
    run(engine, "prime", repeated_tokens(40))
    assert cached_window_positions(cache, repeated_tokens(40), 1) == [3, 4]
    assert run(engine, "follow", repeated_tokens(41))[0] == 0


def test_dense_eagle_windows_of_two_groups_serve_the_dropped_landing() -> None:
    """Two SWA groups, 72 tokens (dense): vLLM 0.33 caches SWA positions 3, 4, 7 and 8 in both
    (blocks 0..8 are full: 64 plus one SWA block), and a 73-token follow-up hits 32: full
    attention matches 64 and drops to 32, and each window group, asked up to 40, matches
    blocks 3 and 4 and drops block 4."""
    engine, cache = build_eagle_windows("dense", num_windows=2)
    run(engine, "prime", repeated_tokens(72))
    for group in (1, 2):
        assert cached_window_positions(cache, repeated_tokens(72), group) == [3, 4, 7, 8]
    assert run(engine, "follow", repeated_tokens(73))[0] == 32


def test_boundary_eagle_window_keeps_one_block_past_the_landing() -> None:
    """Retention 0, 127 tokens: both replay landings under the drop are 64 (floor(126/32)*32 -
    32 and floor(127/32)*32 - 32), and vLLM 0.33 caches SWA positions 7 and 8 (the window before
    64 and one SWA block after it, not a whole alignment unit); the resend hits 64."""
    engine, cache = build_eagle_windows("boundary")
    run(engine, "prime", repeated_tokens(127))
    assert cached_window_positions(cache, repeated_tokens(127), 1) == [7, 8]
    assert run(engine, "resend", repeated_tokens(127))[0] == 64


@pytest.mark.parametrize(
    ("retention", "windows", "first", "second", "cached", "hit"),
    [
        ("boundary", 1, 128, 128, [7, 8, 11, 12], 96),  # landings 64 and 96
        ("boundary", 1, 40, 41, [0], 0),  # both landings below A: clamped to 0, block 0
        ("boundary", 2, 72, 73, [3, 4], 32),  # both landings 32
        ("dense", 1, 127, 127, [3, 4, 7, 8, 11, 12], 64),  # 96 + one block: blocks 0..12
        ("interval:64", 1, 40, 41, [0], 0),  # the landing clamped to 0, as with retention 0
        ("interval:64", 1, 72, 73, [3, 4, 7, 8], 32),  # landing 32, multiple 64
        ("interval:64", 1, 100, 100, [7, 8], 64),  # landing 64 is also the multiple
    ],
)
def test_eagle_window_registration_and_hit_under_each_retention(
    retention: str, windows: int, first: int, second: int, cached: list[int], hit: int
) -> None:
    """The same layout under the other retentions, vLLM 0.33's numbers: a prompt, the SWA
    positions it leaves cached (each window group), and the hit of a follow-up."""
    engine, cache = build_eagle_windows(retention, num_windows=windows)
    run(engine, "prime", repeated_tokens(first))
    for group in range(1, windows + 1):
        assert cached_window_positions(cache, repeated_tokens(first), group) == cached
    assert run(engine, "follow", repeated_tokens(second))[0] == hit


def test_eagle_window_registers_nothing_below_one_scheduler_block() -> None:
    """Retention 0, 24 tokens: vLLM's get_num_cacheable_tokens adds an EAGLE group's extra
    block only once a whole scheduler block is cacheable, so nothing is registered (the
    clamped landing 0 would otherwise keep SWA block 0)."""
    engine, cache = build_eagle_windows("boundary")
    run(engine, "prime", repeated_tokens(24))
    assert cached_window_positions(cache, repeated_tokens(24), 1) == []
    assert cache.num_free_blocks == 99


@pytest.mark.parametrize(
    ("retention", "sibling_cached"),
    [
        ("boundary", [7, 8, 11, 12, 19, 20]),
        ("interval:64", [7, 8, 11, 12, 15, 16, 19, 20, 23, 24]),
    ],
)
def test_eagle_window_keeps_the_landing_below_a_junction(
    retention: str, sibling_cached: list[int]
) -> None:
    """vLLM 0.33 (new since 0.32): under the drop a window group keeps, besides a shared-prefix
    junction J, the landing one block of its own below it, floored to A (J - 32). A 256-token
    prompt, then a 200-token sibling sharing 130 tokens: full attention matches 128 and drops
    to 96, the window has nothing there, so the junction is 96 and the sibling keeps the tails
    at 96 (11, 12) and 64 (7, 8), besides its replay landing 160 (19, 20). A third request
    sharing only 96 tokens then hits 64 (full attention: 96 less its dropped block)."""
    engine, cache = build_eagle_windows(retention)
    prime = repeated_tokens(256)
    sibling = prime[:130] + list(range(1_000, 1_070))
    third = prime[:96] + list(range(2_000, 2_054))
    run(engine, "prime", prime)
    run(engine, "sibling", sibling)
    assert cached_window_positions(cache, sibling, 1) == sibling_cached
    assert run(engine, "third", third)[0] == 64
