"""Cache groups and their pages, as vLLM lays them out for hybrid attention models.

`derive_cache_groups` makes vLLM's uniform-page groups where full and sliding-window layers
mix (Gemma 3 270M: six groups of three layers), and the DeviceCache keeps layer k of every
group in one shared pair of tensors: a block id belongs to one group at a time, so it costs
the pages of one group's layers, not of every layer. A sliding-window model whose block ids
pass from one group to another (freed by one, allocated by the next) still gives transformers'
greedy tokens, and a cache that let two layers of one group share a tensor would not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridserve.executor.torch import cache as cache_module
from hybridserve.executor.torch.cache import (
    DeviceCache,
    default_pool_blocks,
    kv_sharing,
    kv_storage,
)
from hybridserve.executor.torch.models.base import (
    AttentionCache,
    LatentCache,
    LayerCache,
    StateCache,
    derive_cache_groups,
)
from hybridserve.kvcache.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from tests.reference.helpers import (
    assert_greedy_matches,
    hybrid_generate,
    make_checkpoint,
    random_prompt,
)
from tests.reference.test_reference_models import _gemma3_config

BLOCK = 32
SWA = AttentionCache(num_kv_heads=1, head_dim=256, window=512)
FULL = AttentionCache(num_kv_heads=1, head_dim=256)
STATE = StateCache(shapes={"conv": (8, 3), "ssm": (2, 4, 4)})
# Gemma 3 270M: five sliding-window layers, then one full, three times.
GEMMA3_270M = [FULL if (i + 1) % 6 == 0 else SWA for i in range(18)]
PAGE = BLOCK * 2 * 1 * 256 * 4  # K and V, one KV head of 256, float32


def _groups(layers: list[LayerCache], **options: Any) -> tuple[list[tuple[int, ...]], list[Any]]:
    groups = derive_cache_groups(layers, block_size=BLOCK, **options)
    return [groups.layers_of(g) for g in range(len(groups.specs))], list(groups.specs)


def _cache(layers: list[LayerCache], num_blocks: int, **options: Any) -> DeviceCache:
    groups = derive_cache_groups(layers, block_size=BLOCK, **options)
    return DeviceCache(
        layers,
        num_blocks=num_blocks,
        block_size=BLOCK,
        num_scratch_slots=0,
        dtype=torch.float32,
        device=torch.device("cpu"),
        layer_group=groups.layer_group,
    )


def test_gemma3_270m_makes_vllms_six_groups_of_three() -> None:
    # vLLM: g = 3 (the full layers' count; 15 is not under 1.5 x 3); the 15 sliding-window
    # layers split into 5 groups, group i taking the kind's layers i, i + 5, i + 10.
    layers, specs = _groups(GEMMA3_270M)
    assert layers == [(0, 6, 12), (1, 7, 13), (2, 8, 14), (3, 9, 15), (4, 10, 16), (5, 11, 17)]
    window = SlidingWindowSpec(block_size=BLOCK, window=512)
    assert specs == [window] * 5 + [FullAttentionSpec(block_size=BLOCK)]


def test_counts_under_one_and_a_half_times_the_smallest_group_by_the_largest() -> None:
    # 12 sliding + 13 full (gpt-oss-20b with an EAGLE layer, vLLM's example): g = 13.
    layers, _ = _groups([SWA] * 12 + [FULL] * 13)
    assert layers == [tuple(range(12)), tuple(range(12, 25))]
    # 6 is not under 1.5 x 4: g = 4, and the 6 sliding layers make 2 groups of 3.
    layers, specs = _groups([SWA] * 6 + [FULL] * 4)
    assert layers == [(0, 2, 4), (1, 3, 5), (6, 7, 8, 9)]
    assert [type(s) for s in specs] == [SlidingWindowSpec, SlidingWindowSpec, FullAttentionSpec]
    # Two windows are two kinds.
    other = AttentionCache(num_kv_heads=1, head_dim=256, window=1024)
    layers, _ = _groups([SWA, other] * 3)
    assert layers == [(0, 2, 4), (1, 3, 5)]


def test_one_kind_mla_and_state_models_keep_one_group_per_kind() -> None:
    assert _groups([FULL] * 4)[0] == [(0, 1, 2, 3)]
    assert _groups([SWA] * 5)[0] == [(0, 1, 2, 3, 4)]
    mla, specs = _groups([LatentCache(latent_dim=64)] * 3)
    assert mla == [(0, 1, 2)] and specs == [FullAttentionSpec(block_size=BLOCK, mla=True)]
    # Bamba-like and a window/full/state mix: state groups are sized apart; one per kind.
    layers, specs = _groups([STATE, FULL, STATE, STATE])
    assert layers == [(0, 2, 3), (1,)]
    assert [type(s) for s in specs] == [MambaSpec, FullAttentionSpec]
    assert _groups([SWA, SWA, FULL, STATE] * 2)[0] == [(0, 1, 4, 5), (2, 6), (3, 7)]
    # The old grouping on request.
    layers, _ = _groups(GEMMA3_270M, uniform_pages=False)
    assert layers == [tuple(i for i in range(18) if (i + 1) % 6), (5, 11, 17)]


def test_layer_k_of_every_group_shares_one_tensor_pair() -> None:
    cache = _cache(GEMMA3_270M, num_blocks=10)
    assert cache.block_bytes() == 3 * PAGE
    assert cache.allocated_bytes() == 10 * cache.block_bytes()
    first_layers = (0, 1, 2, 3, 4, 5)  # position 0 of each group
    for layer in first_layers:
        for mine, shared in zip(cache.kv(layer), cache.kv(0), strict=True):
            assert mine.data_ptr() == shared.data_ptr()
        assert cache.storage_layer(layer) == 0
        view, shared_view = cache.block_views(layer, 7)[0], cache.block_views(0, 7)[0]
        assert view.data_ptr() == shared_view.data_ptr()
    # Layers of one group never share.
    pointers = {cache.kv(layer)[0].data_ptr() for layer in (0, 6, 12)}
    pointers |= {cache.kv(layer)[1].data_ptr() for layer in (0, 6, 12)}
    assert len(pointers) == 6
    assert kv_storage(GEMMA3_270M, derive_cache_groups(GEMMA3_270M, block_size=BLOCK).layer_group)[
        :7
    ] == [0, 0, 0, 0, 0, 0, 1]
    assert kv_sharing(GEMMA3_270M, _layer_group(GEMMA3_270M)) == 6.0


def _layer_group(layers: list[LayerCache], **options: Any) -> tuple[int, ...]:
    return derive_cache_groups(layers, block_size=BLOCK, **options).layer_group


def test_sharing_follows_any_grouping_and_counts_each_tensor_once() -> None:
    # One group per kind: the 3 full layers share with sliding-window layers 0, 1, 2.
    per_kind = _cache(GEMMA3_270M, num_blocks=4, uniform_pages=False)
    assert per_kind.block_bytes() == 15 * PAGE
    assert per_kind.allocated_bytes() == 4 * per_kind.block_bytes()
    assert kv_sharing(GEMMA3_270M, _layer_group(GEMMA3_270M, uniform_pages=False)) == 18 / 15
    # Without groups, and where shapes differ, nothing is shared.
    alone = DeviceCache(
        GEMMA3_270M,
        num_blocks=4,
        block_size=BLOCK,
        num_scratch_slots=0,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    assert alone.block_bytes() == 18 * PAGE and kv_sharing(GEMMA3_270M) == 1.0
    wide = AttentionCache(num_kv_heads=2, head_dim=256)
    mixed = [SWA, SWA, wide, SWA, SWA, wide]  # 4 sliding + 2 full: three groups of two
    assert _groups(mixed)[0] == [(0, 3), (1, 4), (2, 5)]
    cache = _cache(mixed, num_blocks=4)
    assert [cache.storage_layer(i) for i in range(6)] == [0, 0, 2, 3, 3, 5]
    assert cache.block_bytes() == 2 * PAGE + 2 * 2 * PAGE
    assert cache.allocated_bytes() == 4 * cache.block_bytes()


def test_state_layers_share_nothing() -> None:
    layers: list[LayerCache] = [STATE, FULL, STATE, STATE]
    cache = _cache(layers, num_blocks=5)
    assert [cache.storage_layer(i) for i in range(4)] == [0, 1, 2, 3]
    state_bytes = (8 * 3 + 2 * 4 * 4) * 4
    assert cache.block_bytes() == PAGE + 3 * state_bytes
    assert cache.allocated_bytes() == 5 * cache.block_bytes()


def test_the_default_pool_keeps_its_bytes_in_more_block_ids() -> None:
    # Four requests at 8,192 tokens in 16-token blocks: 2,048 blocks' bytes with a page in
    # every layer; Gemma 3 270M's block id holds 3 of its 18 layers, so 6 x as many ids.
    assert default_pool_blocks(GEMMA3_270M, max_model_len=8192, block_size=16) == 12_288
    assert default_pool_blocks([FULL] * 30, max_model_len=8192, block_size=16) == 2_048
    state_model: list[LayerCache] = [STATE, FULL, STATE, STATE]
    assert default_pool_blocks(state_model, max_model_len=256, block_size=32) == 256


# ----- block ids passing between groups ------------------------------------------------------


def _groups_of_two_config() -> Any:
    """Gemma 3 with 4 sliding-window (window 8) and 2 full layers: three groups of two."""
    config = _gemma3_config()
    config.num_hidden_layers = 6
    config.layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    return config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("gemma3_groups_of_two")
    return folder, make_checkpoint(_groups_of_two_config(), folder)


PROMPTS = [random_prompt(n, seed=40 + n) for n in (21, 30, 17, 26)]


def check_block_ids_pass_between_groups(folder: Path, hf_model: Any) -> None:
    """A pool of 40 blocks: the sliding-window groups free the blocks that leave their window,
    and the other groups take them; tokens equal a run with room to spare and transformers'."""
    small = hybrid_generate(
        folder, PROMPTS, max_tokens=20, num_blocks=40, max_num_batched_tokens=16
    )
    moved = [block for block, groups in small.block_groups.items() if len(groups) > 1]
    assert len(moved) >= 10, "block ids must pass from one group to another"
    large = hybrid_generate(folder, PROMPTS, max_tokens=20, num_blocks=512)
    assert small.tokens == large.tokens
    assert_greedy_matches(hf_model, PROMPTS, small)


def test_block_ids_passing_between_groups_give_transformers_tokens(
    checkpoint: tuple[Path, Any],
) -> None:
    check_block_ids_pass_between_groups(*checkpoint)


def test_the_check_catches_layers_of_one_group_sharing_a_tensor(
    checkpoint: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def one_storage(layers: Any, layer_group: Any = None) -> list[int | None]:
        return [None if isinstance(layer, StateCache) else 0 for layer in layers]

    monkeypatch.setattr(cache_module, "kv_storage", one_storage)
    with pytest.raises(AssertionError):
        check_block_ids_pass_between_groups(*checkpoint)
