"""KV events: what the prefix cache stored, dropped and cleared, in vLLM's KV-event shape.

The types follow vLLM's `vllm/distributed/kv_events.py` (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared`, `KVEventBatch`), field for field and in the same order, so that `wire()`
gives the array vLLM's msgspec structs encode (`array_like=True, tag=True`: the class name, then
the fields). vLLM's `group_idx` is our `group_id`, the cache group the block belongs to; after
it comes `group_kind` (full, swa, mamba, ...), an extension a consumer that does not know it
ignores (it trails). A hybrid-aware consumer keeps one index per group and reconciles.

Block hashes are the cache's own chained hashes (`hashing.py`: 32 bytes of SHA-256, or 16 of
xxh3-128), the key of the pool's hash map without its group suffix; `parent_block_hash` is the
hash of the block before at the same group's block size, None for the first block. They are
reproducible: `BlockHasher(hash_block_size)` over the same tokens gives the same bytes in any
process. One `BlockStored` names one block (vLLM groups a request's run of newly full blocks
in one event; a consumer treats both alike). A partial tail (fine-grained hits) is a block
holding fewer tokens than its group's block size: its `block_size` is the tokens it holds. The
same hash can be stored twice (the pool does not deduplicate, as vLLM's does not): a consumer
counts stores against removals.

The cache emits nothing unless a sink is attached (`attach_events`); the pool then calls
`CacheEvents` as blocks are registered (`BlockStored`), lose their hash to an eviction, an
`uncache` or a superseding full block (`BlockRemoved`), and when the prefix cache is reset
(`AllBlocksCleared`). A turn's exact end kept on the host tier under a tail key
(`hashing.tail_key`) is the engine's own: no event names it. Everything here is pure Python:
the ZMQ publisher lives in `hybridserve.server.kv_events`, and the simulator's router feeds
`CacheMirror` in-process.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from hybridserve.kvcache.block_pool import Block
from hybridserve.kvcache.hashing import BlockHash, cache_key, is_tail_key
from hybridserve.kvcache.layout import CacheLayout
from hybridserve.kvcache.manager import KVCacheManager

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"  # the host tier's blocks (vLLM's offloading emits the same medium)
_SUFFIX = len(cache_key(b"", 0))  # the group id after the hash in a pool key


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]  # the blocks' tokens; empty when no token source is attached
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_id: int = 0  # vLLM's group_idx
    group_kind: str = "full"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = MEDIUM_GPU
    group_id: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
KVEventSink = Callable[[KVEvent], None]
_TYPES: dict[str, type[BlockStored] | type[BlockRemoved] | type[AllBlocksCleared]] = {
    cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)
}


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The events of one publication, and when it was made (seconds since the epoch)."""

    ts: float
    events: tuple[KVEvent, ...] = field(default_factory=tuple)


def wire(event: KVEvent) -> list[Any]:
    """The event as vLLM's tagged array: [type name, field, field, ...] (tuples as lists)."""
    out: list[Any] = [type(event).__name__]
    for f in fields(event):
        value = getattr(event, f.name)
        out.append(list(value) if isinstance(value, tuple) else value)
    return out


def batch_wire(batch: KVEventBatch) -> list[Any]:
    """The batch as vLLM's `KVEventBatch` array: [ts, [event, ...]]."""
    return [batch.ts, [wire(event) for event in batch.events]]


def from_wire(data: Sequence[Any]) -> KVEvent:
    """The event that `wire` encoded (a subscriber's decoder). Trailing fields it does not know
    are ignored, missing trailing fields take their defaults."""
    if not data or data[0] not in _TYPES:
        raise ValueError(f"not a KV event: {data[:1]!r}; expected one of {sorted(_TYPES)}")
    cls = _TYPES[data[0]]
    names = [f.name for f in fields(cls)]
    values: dict[str, Any] = {
        name: tuple(value) if isinstance(value, list) and name != "extra_keys" else value
        for name, value in zip(names, data[1:], strict=False)
    }
    return cls(**values)


def batch_from_wire(data: Sequence[Any]) -> KVEventBatch:
    return KVEventBatch(float(data[0]), tuple(from_wire(event) for event in data[1]))


class CacheEvents:
    """Builds one cache's events from the pool's and groups' calls and hands each to the sinks.

    `tokens_of(req_id)` gives a request's tokens (prompt and output) for `token_ids`; without
    it `token_ids` is empty (the simulator's router reads hashes only).
    """

    __slots__ = ("block_sizes", "kinds", "sinks", "tokens_of")

    def __init__(
        self,
        cache: KVCacheManager,
        *,
        tokens_of: Callable[[str], Sequence[int]] | None = None,
    ) -> None:
        self.sinks: list[KVEventSink] = []
        self.block_sizes = tuple(g.block_size for g in cache.groups)
        self.kinds = tuple(g.kind.value for g in cache.groups)
        self.tokens_of = tokens_of

    def emit(self, event: KVEvent) -> None:
        for sink in self.sinks:
            sink(event)

    def stored(
        self,
        group_id: int,
        block_hash: BlockHash,
        parent: BlockHash | None,
        req_id: str,
        start: int,
        end: int,
    ) -> None:
        """A block of `req_id` holding tokens [start, end) was registered under `block_hash`."""
        tokens: tuple[int, ...] = ()
        if self.tokens_of is not None:
            tokens = tuple(self.tokens_of(req_id)[start:end])
        self.emit(
            BlockStored(
                (block_hash,),
                parent,
                tokens,
                end - start,
                group_id=group_id,
                group_kind=self.kinds[group_id],
            )
        )

    def removed(self, key: bytes, group_id: int) -> None:
        """The pool dropped `key` (hash + group suffix) from one block."""
        if is_tail_key(key):
            return  # a turn's exact end: never announced, never a prefix
        self.emit(BlockRemoved((key[:-_SUFFIX],), group_id=group_id))

    def cleared(self) -> None:
        self.emit(AllBlocksCleared())

    def promoted(self, key: bytes, group_id: int) -> None:
        """A block came back from the host tier to the device under `key` (its tokens and
        parent are not known there)."""
        if is_tail_key(key):
            return
        self.emit(
            BlockStored(
                (key[:-_SUFFIX],),
                None,
                (),
                self.block_sizes[group_id],
                group_id=group_id,
                group_kind=self.kinds[group_id],
            )
        )

    def host_changed(self, key: bytes, group_id: int, stored: bool) -> None:
        """The host tier took `key` (saved) or gave it up (loaded back or dropped): the
        medium is CPU. Its tokens and parent are not known there (empty and None)."""
        if is_tail_key(key):
            return
        block_hash = key[:-_SUFFIX]
        if stored:
            self.emit(
                BlockStored(
                    (block_hash,),
                    None,
                    (),
                    self.block_sizes[group_id],
                    medium=MEDIUM_CPU,
                    group_id=group_id,
                    group_kind=self.kinds[group_id],
                )
            )
        else:
            self.emit(BlockRemoved((block_hash,), medium=MEDIUM_CPU, group_id=group_id))


def attach_events(
    cache: KVCacheManager,
    sink: KVEventSink,
    *,
    tokens_of: Callable[[str], Sequence[int]] | None = None,
) -> CacheEvents:
    """Send `cache`'s events to `sink` from now on (one more sink if some are attached). Call
    before the cache holds anything, or the consumer misses what is cached already."""
    events = cache.pool.events
    if events is None:
        events = CacheEvents(cache, tokens_of=tokens_of)
        cache.pool.events = events
        if cache.host is not None:
            cache.host.on_change = events.host_changed
    elif tokens_of is not None:
        events.tokens_of = tokens_of
    events.sinks.append(sink)
    return events


class CacheMirror:
    """A consumer's copy of one cache's hash map, built from its events alone: per group, the
    hashes stored and not yet removed (counted: a hash can be stored twice).

    It is a KVCacheManager over the same layout that holds no KV: its pool carries one empty
    placeholder block per stored event, registered under the event's key. Events of either
    medium count: a block on the host tier is a hit too (its admission loads it). Its `find_hit` is
    therefore the real cache's own lookup and reconciliation over the same hash map, so for the
    same hashes it gives the same hit, and the same per-group offers, as the cache would.
    """

    def __init__(self, layout: CacheLayout, *, enable_caching: bool = True) -> None:
        self.cache = KVCacheManager(
            dataclasses.replace(layout, num_blocks=2, host_blocks=0),
            enable_caching=enable_caching,
            enable_metrics=False,
        )
        self._blocks: dict[bytes, list[Block]] = {}
        self._ids = itertools.count(2)  # placeholder ids, past the mirror pool's own blocks
        self.num_stored = 0

    def __call__(self, event: KVEvent) -> None:
        pool = self.cache.pool
        if isinstance(event, BlockStored):
            for block_hash in event.block_hashes:
                key = cache_key(block_hash, event.group_id)
                block = Block(next(self._ids))
                pool.register(block, key, event.group_id)
                self._blocks.setdefault(key, []).append(block)
                self.num_stored += 1
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                key = cache_key(block_hash, event.group_id)
                held = self._blocks.get(key)
                if not held:
                    raise ValueError(
                        f"BlockRemoved of {block_hash.hex()} in group {event.group_id}, "
                        "which was never stored: the mirror missed events (attach it before "
                        "the cache holds anything)"
                    )
                pool.unregister(held.pop())
                if not held:
                    del self._blocks[key]
                self.num_stored -= 1
        else:
            for held in self._blocks.values():
                for block in held:
                    pool.unregister(block)
            self._blocks.clear()
            self.num_stored = 0

    @classmethod
    def of(cls, cache: KVCacheManager) -> CacheMirror:
        """A mirror fed by `cache`'s events from now on (attach it while `cache` is empty)."""
        mirror = cls(cache.layout, enable_caching=cache.enable_caching)
        attach_events(cache, mirror)
        return mirror

    def counts(self) -> dict[bytes, int]:
        """Per pool key (hash + group suffix), the blocks stored under it and not removed."""
        return {key: len(blocks) for key, blocks in self._blocks.items()}

    def num_cached(self, group_id: int) -> int:
        """Blocks of `group_id` stored and not removed."""
        suffix = cache_key(b"", group_id)
        return sum(len(v) for k, v in self._blocks.items() if k.endswith(suffix))
