"""Hybrid prefix KV cache: hashing, block pool, one manager per group kind, reconciliation."""

from hybridserve.kvcache.layout import CacheLayout
from hybridserve.kvcache.manager import Allocation, CacheHit, KVCacheManager
from hybridserve.kvcache.retention import Retention
from hybridserve.kvcache.spec import (
    ChunkedLocalSpec,
    DraftSpec,
    FullAttentionSpec,
    GroupKind,
    GroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

__all__ = [
    "Allocation",
    "CacheHit",
    "CacheLayout",
    "ChunkedLocalSpec",
    "DraftSpec",
    "FullAttentionSpec",
    "GroupKind",
    "GroupSpec",
    "KVCacheManager",
    "MambaSpec",
    "Retention",
    "SlidingWindowSpec",
]
