"""The cache-only replay: admit requests in timestamp order, keep N resident, finish the oldest.

Each admission looks up the reconciled hit, resumes there and prefills the rest in one chunk per
state checkpoint (an align-mode scheduler ends chunks where states must be kept); on finish the
output tokens are appended and registered, then every block is freed. Under a finite pool the
oldest resident requests finish early to make room; a request that cannot fit even alone is
counted as rejected, never silently dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hybridserve.cache_replay.trace import TraceRecord
from hybridserve.kvcache import CacheHit, CacheLayout, KVCacheManager
from hybridserve.kvcache.hashing import BlockHash


@dataclass(slots=True)
class ReplayResult:
    layout_name: str
    retention: str
    speculation: str
    requests: int = 0
    rejected: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    cacheable_tokens: int = 0
    ideal_hit_tokens: int = 0
    group_names: list[str] = field(default_factory=list)
    group_hit_tokens: list[int] = field(default_factory=list)
    group_limiting: list[int] = field(default_factory=list)
    registered_blocks: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def ideal_full_attention_hit_rate(self) -> float:
        return self.ideal_hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "layout": self.layout_name,
            "retention": self.retention,
            "spec": self.speculation,
            "requests": self.requests,
            "rejected_requests": self.rejected,
            "queried_tokens": self.queried_tokens,
            "cacheable_tokens": self.cacheable_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": round(self.hit_rate, 6),
            "group_hit_tokens": dict(zip(self.group_names, self.group_hit_tokens, strict=True)),
            "group_limiting_admissions": dict(
                zip(self.group_names, self.group_limiting, strict=True)
            ),
            "ideal_full_attention_hit_rate": round(self.ideal_full_attention_hit_rate, 6),
            "registered_blocks": self.registered_blocks,
            "evicted_blocks": self.evicted_blocks,
        }


@dataclass(slots=True)
class _Resident:
    req_id: str
    record: TraceRecord
    tokens: list[int]
    hashes: list[BlockHash]


def ideal_hit_tokens(records: Sequence[TraceRecord]) -> int:
    """Full attention with an infinite cache at the trace's own 512-token blocks: each request
    hits its leading hash ids already seen, left to right until the first unseen one."""
    seen: set[int] = set()
    total = 0
    for record in records:
        matched = 0
        for block_id in record.hash_ids:
            if block_id not in seen:
                break
            matched += 1
        total += min(matched * 512, record.input_length)
        seen.update(record.hash_ids)
    return total


class CacheReplay:
    """Drives one KVCacheManager through a trace."""

    def __init__(self, layout: CacheLayout, *, concurrency: int, unbounded: bool) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency={concurrency}; use 1 or more")
        self.manager = KVCacheManager(layout, unbounded=unbounded)
        self.concurrency = concurrency
        self.resident: deque[_Resident] = deque()
        self.rejected = 0

    def run(
        self,
        records: Sequence[TraceRecord],
        *,
        name: str,
        progress: Callable[[int], None] | None = None,
    ) -> ReplayResult:
        for done, record in enumerate(records, start=1):
            self._admit(record)
            while len(self.resident) > self.concurrency:
                self._finish(self.resident.popleft())
            if progress is not None:
                progress(done)
        while self.resident:
            self._finish(self.resident.popleft())
        self.manager.check_invariants()
        return self._result(records, name)

    def _admit(self, record: TraceRecord) -> None:
        manager = self.manager
        req_id = f"r{record.index}"
        tokens = record.prompt_tokens()
        hashes = manager.hasher.hash_tokens(tokens)
        while True:
            manager.new_step()
            hit = manager.find_hit(hashes, len(tokens))
            ends = [p for p in manager.planned_checkpoints(len(tokens), hit) if p > hit.num_tokens]
            ends.append(len(tokens))
            if self._prefill(req_id, tokens, hashes, hit, ends):
                self.resident.append(_Resident(req_id, record, tokens, hashes))
                return
            if not self.resident:
                self.rejected += 1
                return
            self._finish(self.resident.popleft())

    def _prefill(
        self,
        req_id: str,
        tokens: list[int],
        hashes: list[BlockHash],
        hit: CacheHit,
        ends: list[int],
    ) -> bool:
        manager = self.manager
        position = hit.num_tokens
        for index, end in enumerate(ends):
            if index:
                manager.new_step()
            allocation = manager.allocate(
                req_id,
                hashes,
                num_tokens=len(tokens),
                num_computed_tokens=0 if index == 0 else position,
                num_new_tokens=end - position,
                hit=hit if index == 0 else None,
                num_prompt_tokens=len(tokens),
                # Reserve the whole prompt up front, so later chunks never fail.
                full_sequence_must_fit=index == 0,
            )
            if allocation is None:
                if index:
                    manager.free(req_id)  # give back what the partial prefill holds
                return False
            position = end
        return True

    def _finish(self, resident: _Resident) -> None:
        manager = self.manager
        outputs = resident.record.output_tokens()
        if outputs:
            computed = len(resident.tokens)
            resident.tokens.extend(outputs)
            manager.hasher.extend(resident.hashes, resident.tokens)
            manager.new_step()
            manager.allocate(
                resident.req_id,
                resident.hashes,
                num_tokens=len(resident.tokens),
                num_computed_tokens=computed,
                num_new_tokens=len(outputs),
            )  # under pressure the outputs simply go unregistered
        manager.free(resident.req_id)

    def _result(self, records: Sequence[TraceRecord], name: str) -> ReplayResult:
        manager = self.manager
        layout = manager.layout
        metrics = manager.metrics
        names = [f"{g}:{spec.kind.value}" for g, spec in enumerate(layout.groups)]
        return ReplayResult(
            layout_name=name,
            retention=layout.retention.name,
            speculation=layout.speculative.method.value,
            requests=metrics.requests,
            rejected=self.rejected,
            queried_tokens=sum(r.input_length for r in records),
            hit_tokens=metrics.hit_tokens,
            cacheable_tokens=metrics.cacheable_tokens,
            ideal_hit_tokens=ideal_hit_tokens(records),
            group_names=names,
            group_hit_tokens=list(metrics.group_offered_tokens),
            group_limiting=list(metrics.group_limiting),
            registered_blocks=sum(manager.registered_blocks()),
            evicted_blocks=sum(manager.evicted_blocks()),
        )
