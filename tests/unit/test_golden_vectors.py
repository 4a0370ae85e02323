"""The golden vectors of SPEC.md 3.4/3.5/4.2, built token for token as SPEC.md describes."""

from __future__ import annotations

from hybridserve.core.config import SpeculativeConfig
from hybridserve.kvcache import (
    CacheLayout,
    DraftSpec,
    FullAttentionSpec,
    KVCacheManager,
    MambaSpec,
    Retention,
)
from tests.conftest import prefill

A = 2304


def lp14_manager(
    *, dcp: int = 1, retention: str = "boundary+predecessor", speculation: str = "eagle-legacy"
) -> KVCacheManager:
    layout = CacheLayout(
        groups=(
            FullAttentionSpec(block_size=A, mla=True),
            MambaSpec(block_size=A),
            DraftSpec(block_size=A, window=2048, extra_tokens=2048),
        ),
        num_blocks=20_000,
        hash_block_size=A,
        alignment_tokens=A,
        dcp=dcp,
        speculative=SpeculativeConfig.from_name(speculation),
        retention=Retention.parse(retention),
    )
    return KVCacheManager(layout)


def warm_and_turn(start: int = 0) -> tuple[list[int], list[int]]:
    warm = list(range(start, start + 122_871))
    turn_1 = warm[:122_869] + list(range(start + 200_000, start + 212_279))
    return warm, turn_1


def test_lp14_turn_reuses_predecessor_boundary_at_dcp1() -> None:
    manager = lp14_manager()
    warm, turn_1 = warm_and_turn()
    prefill(manager, "warm", warm, chunk=A)
    hashes = manager.hasher.hash_tokens(turn_1)
    hit = manager.find_hit(hashes, len(turn_1))
    assert len(turn_1) == 135_148
    assert hit.num_tokens == 119_808
    assert hit.sample is not None
    assert hit.sample.group_offered_tokens == (119_808, 122_112, 119_808)
    assert len(turn_1) - hit.num_tokens == 15_340


def test_lp14_turn_with_vllm_033_boundary_retention_reuses_the_dropped_landing() -> None:
    # vLLM 0.33's replay_boundaries under the EAGLE drop keeps where the dropped lookup lands:
    # SPEC.md's "0 without predecessor retention" is the pre-0.33 rule (boundary-only).
    manager = lp14_manager(retention="boundary")
    warm, turn_1 = warm_and_turn()
    prefill(manager, "warm", warm, chunk=A)
    hit = manager.find_hit(manager.hasher.hash_tokens(turn_1), len(turn_1))
    assert hit.num_tokens == 119_808


def test_lp14_turn_without_predecessor_retention_reuses_nothing() -> None:
    manager = lp14_manager(retention="boundary-only")
    warm, turn_1 = warm_and_turn()
    prefill(manager, "warm", warm, chunk=A)
    hit = manager.find_hit(manager.hasher.hash_tokens(turn_1), len(turn_1))
    assert hit.num_tokens == 0


def test_lp14_turn_at_dcp4_lands_one_alignment_unit_lower() -> None:
    manager = lp14_manager(dcp=4)
    assert manager.layout.page_tokens == 9_216
    warm, turn_1 = warm_and_turn()
    prefill(manager, "warm", warm, chunk=A)
    hit = manager.find_hit(manager.hasher.hash_tokens(turn_1), len(turn_1))
    assert hit.num_tokens == 117_504
    assert hit.sample is not None
    # Mamba and the replicated draft offer what DCP1 offers; the sharded target lands lower.
    assert hit.sample.group_offered_tokens[1:] == (122_112, 119_808)
    assert hit.sample.group_offered_tokens[0] == 117_504


def test_twenty_agents_three_growing_turns_reuse_golden_totals() -> None:
    manager = lp14_manager()
    turns: list[list[list[int]]] = []
    for agent in range(20):
        start = agent * 1_000_000
        warm, turn_1 = warm_and_turn(start)
        turn_2 = turn_1 + list(range(start + 300_000, start + 312_269))
        turn_3 = turn_2 + list(range(start + 400_000, start + 412_269))
        turns.append([warm, turn_1, turn_2, turn_3])
    for agent in range(20):
        prefill(manager, f"warm-{agent}", turns[agent][0], chunk=A)
    total = 0
    for turn in (1, 2, 3):
        for agent in range(20):
            hit = prefill(manager, f"a{agent}-t{turn}", turns[agent][turn], chunk=A)
            assert hit.num_tokens == {1: 119_808, 2: 131_328, 3: 142_848}[turn]
            total += hit.num_tokens
    assert total == 7_879_680


def test_dflash_gets_the_non_speculative_hit() -> None:
    hits = {}
    for speculation in ("none", "dflash"):
        manager = lp14_manager(speculation=speculation)
        warm, turn_1 = warm_and_turn()
        prefill(manager, "warm", warm, chunk=A)
        hits[speculation] = manager.find_hit(
            manager.hasher.hash_tokens(turn_1), len(turn_1)
        ).num_tokens
    assert hits["dflash"] == hits["none"] == 122_112


def test_backoff_uses_alignment_unit_when_mamba_block_is_smaller() -> None:
    layout = CacheLayout(
        groups=(FullAttentionSpec(block_size=64), MambaSpec(block_size=32)),
        num_blocks=256,
        hash_block_size=32,
        alignment_tokens=64,
        speculative=SpeculativeConfig.from_name("eagle-legacy"),
        retention=Retention.parse("boundary+predecessor"),
    )
    manager = KVCacheManager(layout)
    producer = [t for t in range(7) for _ in range(32)] + [7] * 31
    assert len(producer) == 255
    prefill(manager, "producer", producer, chunk=10_000, chunk_ends=(64, 128, 192))
    hit = manager.find_hit(manager.hasher.hash_tokens(producer), len(producer))
    assert hit.num_tokens == 128


def test_mamba_retention_with_lookahead_slots_reuses_predecessor() -> None:
    layout = CacheLayout(
        groups=(FullAttentionSpec(block_size=32), MambaSpec(block_size=32)),
        num_blocks=256,
        speculative=SpeculativeConfig.from_name("eagle-legacy", 3),
        retention=Retention.parse("boundary+predecessor"),
    )
    manager = KVCacheManager(layout)
    producer = [0] * 32 + [1] * 32 + [2] * 32 + [3] * 31
    hashes = manager.hasher.hash_tokens(producer)
    first, position = True, 0
    for end in (32, 64, 96, 127):
        manager.new_step()
        hit = manager.find_hit(hashes, len(producer)) if first else None
        assert manager.allocate(
            "producer",
            hashes,
            num_tokens=len(producer),
            num_computed_tokens=position,
            num_new_tokens=end - position,
            num_lookahead_tokens=3,
            hit=hit,
            num_prompt_tokens=len(producer),
        )
        first, position = False, end
    manager.free("producer")
    manager.new_step()
    assert manager.find_hit(hashes, len(producer)).num_tokens == 64
