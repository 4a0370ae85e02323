"""The TorchExecutor's host cache: a step's host saves run, then its loads, then its block
copies, also in a step with no chunks; a slot saved and loaded in one step reads what was
saved; every layer of a group (K/V, conv and recurrent states) and the block's token ids go
along."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hybridserve.core.config import SpeculativeConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import BlockCopy, HostCopy, StepPlan
from hybridserve.executor.torch import TorchExecutor
from hybridserve.executor.torch.loader import build_model
from tests.reference.test_bamba import _bamba_config
from tests.reference.test_qwen3_next import _qwen3_5_config
from tests.reference.test_reference_models import _gemma3_config, _llama_config

BLOCK = 4
MODELS: dict[str, Callable[[], Any]] = {
    "llama": _llama_config,
    "gemma3": _gemma3_config,
    "bamba": _bamba_config,
    "qwen3_5": _qwen3_5_config,
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def executor(request: pytest.FixtureRequest) -> TorchExecutor:
    torch.manual_seed(0)
    model = build_model(MODELS[request.param]().to_dict())
    return TorchExecutor(model, num_blocks=8, block_size=BLOCK, host_blocks=2)


def _layers(executor: TorchExecutor, group_id: int) -> tuple[int, ...]:
    return executor.groups.layers_of(group_id)


def _fill(executor: TorchExecutor, group_id: int, block_id: int) -> list[torch.Tensor]:
    """Random content in every tensor of one block of a group; a copy of it."""
    out = []
    for layer in _layers(executor, group_id):
        for view in executor.cache.block_views(layer, block_id):
            view.copy_(torch.randn(view.shape))
            out.append(view.clone())
    return out


def _read(executor: TorchExecutor, group_id: int, block_id: int) -> list[torch.Tensor]:
    return [
        view.clone()
        for layer in _layers(executor, group_id)
        for view in executor.cache.block_views(layer, block_id)
    ]


def _assert_holds(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def _plan(step_id: int, **fields: Any) -> StepPlan:
    return StepPlan(step_id=step_id, chunks=(), **fields)


def test_a_step_without_chunks_saves_then_loads_then_copies(executor: TorchExecutor) -> None:
    for gid in range(len(executor.groups.specs)):
        saved = _fill(executor, gid, 1)
        _fill(executor, gid, 2)
        _fill(executor, gid, 3)
        result = executor.execute(
            _plan(
                0,
                host_saves=(HostCopy(gid, 1, 0),),
                host_loads=(HostCopy(gid, 2, 0),),
                block_copies=(BlockCopy(gid, 2, 3, BLOCK),),
            )
        )
        assert result.sampled_token_ids == {}
        _assert_holds(_read(executor, gid, 2), saved)
        # The copy ran after the load: block 3 holds what block 2 received.
        _assert_holds(_read(executor, gid, 3), saved)


def test_a_slot_saved_and_loaded_in_one_step_reads_what_was_saved(
    executor: TorchExecutor,
) -> None:
    for gid in range(len(executor.groups.specs)):
        _fill(executor, gid, 1)
        executor.execute(_plan(0, host_saves=(HostCopy(gid, 1, 1),)))
        newer = _fill(executor, gid, 2)
        executor.execute(
            _plan(1, host_saves=(HostCopy(gid, 2, 1),), host_loads=(HostCopy(gid, 4, 1),))
        )
        _assert_holds(_read(executor, gid, 4), newer)


def test_only_the_copied_block_changes(executor: TorchExecutor) -> None:
    """A block id belongs to one group at a time, and groups may share tensors (layer k of
    every group): a load writes the loaded block of its group's layers and nothing else."""
    last = len(executor.groups.specs) - 1
    before = _fill(executor, last, 5)
    _fill(executor, 0, 6)
    executor.execute(_plan(0, host_saves=(HostCopy(0, 6, 0),), host_loads=(HostCopy(0, 7, 0),)))
    _assert_holds(_read(executor, last, 5), before)


def test_a_slot_holds_the_bytes_of_one_block_id(executor: TorchExecutor) -> None:
    """Host slots mirror the device storage: tensors shared by layers of different groups on
    the device are shared in the slot too, so host memory is slots x block bytes."""
    assert executor.host_cache is not None
    assert executor.host_cache.allocated_bytes() == 2 * executor.block_bytes


def test_the_token_ids_of_a_block_go_along() -> None:
    torch.manual_seed(0)
    executor = TorchExecutor(
        build_model(_llama_config().to_dict()), num_blocks=8, block_size=BLOCK, host_blocks=1
    )
    tokens = executor._slot_tokens
    assert tokens is not None
    tokens[2 * BLOCK : 3 * BLOCK] = torch.tensor([11, 12, 13, 14])
    executor.execute(_plan(0, host_saves=(HostCopy(0, 2, 0),), host_loads=(HostCopy(0, 6, 0),)))
    assert tokens[6 * BLOCK : 7 * BLOCK].tolist() == [11, 12, 13, 14]


def test_host_copies_need_a_host_cache_large_enough() -> None:
    torch.manual_seed(0)
    model = build_model(_llama_config().to_dict())
    without = TorchExecutor(model, num_blocks=8, block_size=BLOCK)
    with pytest.raises(ConfigError, match="host_blocks"):
        without.execute(_plan(0, host_saves=(HostCopy(0, 1, 0),)))
    small = TorchExecutor(model, num_blocks=8, block_size=BLOCK, host_blocks=2)
    assert small.cache_layout().host_blocks == 2
    assert small.host_cache is not None and not small.host_cache.pinned
    with pytest.raises(ConfigError, match="host slot 2"):
        small.execute(_plan(0, host_loads=(HostCopy(0, 1, 2),)))
    with pytest.raises(ValueError, match="block_id=8"):
        small.execute(_plan(0, host_saves=(HostCopy(0, 8, 0),)))


def test_a_draft_heads_next_tokens_go_along() -> None:
    torch.manual_seed(0)
    executor = TorchExecutor(
        build_model(_llama_config().to_dict()),
        num_blocks=8,
        block_size=BLOCK,
        speculative=SpeculativeConfig.from_name("mtp", 2),
        host_blocks=1,
    )
    assert executor.drafter is not None
    group, next_token = executor.drafter.group_id, executor.drafter.next_token
    head_kv = _fill(executor, group, 2)
    next_token[2 * BLOCK : 3 * BLOCK] = torch.tensor([21, 22, 23, 24])
    plan = _plan(0, host_saves=(HostCopy(group, 2, 0),), host_loads=(HostCopy(group, 6, 0),))
    executor.execute(plan)
    assert next_token[6 * BLOCK : 7 * BLOCK].tolist() == [21, 22, 23, 24]
    _assert_holds(_read(executor, group, 6), head_kv)
    assert executor.drafter.head.layer_index in _layers(executor, group)
