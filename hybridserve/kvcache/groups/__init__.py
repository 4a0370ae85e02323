"""One manager per cache-group kind, each owning its hit rule and its allocation shape."""

from __future__ import annotations

from hybridserve.kvcache.block_pool import BlockPool
from hybridserve.kvcache.groups.attention import (
    ChunkedLocalManager,
    FullAttentionManager,
    SlidingWindowManager,
)
from hybridserve.kvcache.groups.base import GroupContext, GroupLookup, GroupManager
from hybridserve.kvcache.groups.mamba import MambaManager
from hybridserve.kvcache.spec import (
    ChunkedLocalSpec,
    DraftSpec,
    FullAttentionSpec,
    GroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)


def make_manager(spec: GroupSpec, ctx: GroupContext, pool: BlockPool) -> GroupManager:
    """The manager for one group spec."""
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(spec, ctx, pool)
    if isinstance(spec, SlidingWindowSpec | DraftSpec):
        return SlidingWindowManager(spec, ctx, pool)
    if isinstance(spec, ChunkedLocalSpec):
        return ChunkedLocalManager(spec, ctx, pool)
    if isinstance(spec, MambaSpec):
        return MambaManager(spec, ctx, pool)
    raise TypeError(f"unknown group spec {spec!r}")


__all__ = ["GroupContext", "GroupLookup", "GroupManager", "make_manager"]
