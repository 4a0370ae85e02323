"""Shared builders for the test suite."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from hybridserve.core.config import SchedulerConfig
from hybridserve.core.paths import DATA_ENV, data_dir
from hybridserve.core.request import Request, SamplingParams
from hybridserve.executor.fake import FakeExecutor
from hybridserve.kvcache import (
    CacheHit,
    CacheLayout,
    FullAttentionSpec,
    GroupSpec,
    KVCacheManager,
    MambaSpec,
)
from hybridserve.scheduler import Scheduler

DATA_DIR = data_dir()


def require_data(*parts: str) -> Path:
    """The path under the data folder (the repository's data/, or $HYBRIDSERVE_DATA). The
    repository ships every file the tests read, so a missing one fails the test."""
    path = DATA_DIR.joinpath(*parts)
    if not path.exists():
        pytest.fail(f"{path} is absent: restore data/ or point {DATA_ENV} at a full copy")
    return path


def prefill(
    manager: KVCacheManager,
    req_id: str,
    tokens: Sequence[int],
    *,
    chunk: int,
    chunk_ends: Sequence[int] = (),
    free: bool = True,
) -> CacheHit:
    """Admit `tokens`, resume at its hit, prefill the rest in steps of at most `chunk` tokens
    (also ending a chunk at each of `chunk_ends` and at each state checkpoint the cache asks
    for, as an align-mode scheduler does), then free it. Returns the admission hit."""
    hashes = manager.hasher.hash_tokens(tokens)
    manager.new_step()
    hit = manager.find_hit(hashes, len(tokens))
    chunk_ends = (*chunk_ends, *manager.planned_checkpoints(len(tokens), hit))
    position = hit.num_tokens
    first = True
    while position < len(tokens):
        end = min(position + chunk, len(tokens))
        end = min([e for e in chunk_ends if position < e < end] + [end])
        if not first:
            manager.new_step()
        allocation = manager.allocate(
            req_id,
            hashes,
            num_tokens=len(tokens),
            num_computed_tokens=0 if first else position,
            num_new_tokens=end - position,
            hit=hit if first else None,
            num_prompt_tokens=len(tokens),
        )
        assert allocation is not None, f"{req_id}: allocation failed at {position}"
        if first:
            manager.check_invariants()
        first = False
        position = end
    if free:
        manager.free(req_id)
        manager.check_invariants()
    return hit


def make_scheduler(
    *,
    block_size: int = 16,
    num_blocks: int = 4096,
    mamba: bool = False,
    host_blocks: int = 0,
    **config: object,
) -> Scheduler:
    """A scheduler over a full-attention (optionally + align-mode Mamba) cache, with a host
    tier of `host_blocks` slots (0: none)."""
    groups: tuple[GroupSpec, ...] = (FullAttentionSpec(block_size=block_size),)
    if mamba:
        groups = (*groups, MambaSpec(block_size=block_size))
    layout = CacheLayout(groups=groups, num_blocks=num_blocks, host_blocks=host_blocks)
    return Scheduler(SchedulerConfig(**config), KVCacheManager(layout))  # type: ignore[arg-type]


def make_request(
    req_id: str, prompt_len: int, *, max_tokens: int = 4, arrival: float = 0.0, base: int = 0
) -> Request:
    return Request(
        req_id=req_id,
        prompt_token_ids=tuple(range(base, base + prompt_len)),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        arrival_time=arrival,
    )


def fake_executor() -> FakeExecutor:
    return FakeExecutor(lambda req_id, t: 7 + t)
