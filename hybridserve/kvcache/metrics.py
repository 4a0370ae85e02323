"""Cache metrics (SPEC.md 6.2): staged at lookup, committed once at admission.

Names follow vLLM's `vllm:prefix_cache_queries`/`_hits` under the `hybridserve:` namespace.
Labels are only a group index and its kind: never a request id, a hash or token content.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NAMESPACE = "hybridserve"


@dataclass(frozen=True, slots=True)
class AdmissionSample:
    """One request's lookup result, staged on its CacheHit until admission."""

    queried_tokens: int
    cacheable_tokens: int
    hit_tokens: int
    group_offered_tokens: tuple[int, ...]
    limiting_group: int | None
    resumed: bool  # a preempted request coming back: recorded apart, out of the hit rate
    host_hit_tokens: int = 0  # of hit_tokens, those the host tier served (0 without one)


@dataclass(slots=True)
class CacheMetrics:
    """Counters for one cache. `snapshot()` gives plain numbers; `samples()` Prometheus ones."""

    group_kinds: tuple[str, ...]
    requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    cacheable_tokens: int = 0
    preempted_requests: int = 0
    preempted_queried_tokens: int = 0
    preempted_hit_tokens: int = 0
    host_hit_tokens: int = 0
    group_offered_tokens: list[int] = field(default_factory=list)
    group_limiting: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.group_offered_tokens = [0] * len(self.group_kinds)
        self.group_limiting = [0] * len(self.group_kinds)

    def commit(self, sample: AdmissionSample) -> None:
        if sample.resumed:
            self.preempted_requests += 1
            self.preempted_queried_tokens += sample.queried_tokens
            self.preempted_hit_tokens += sample.hit_tokens
            return
        self.requests += 1
        self.queried_tokens += sample.queried_tokens
        self.hit_tokens += sample.hit_tokens
        self.host_hit_tokens += sample.host_hit_tokens
        self.cacheable_tokens += sample.cacheable_tokens
        for g, offered in enumerate(sample.group_offered_tokens):
            self.group_offered_tokens[g] += offered
        if sample.limiting_group is not None:
            self.group_limiting[sample.limiting_group] += 1

    def snapshot(self, *, registered: list[int], evicted: list[int]) -> dict[str, object]:
        groups = [
            {
                "group": g,
                "kind": kind,
                "offered_hit_tokens": self.group_offered_tokens[g],
                "limiting": self.group_limiting[g],
                "registered_blocks": registered[g],
                "evicted_blocks": evicted[g],
            }
            for g, kind in enumerate(self.group_kinds)
        ]
        return {
            "requests": self.requests,
            "queried_tokens": self.queried_tokens,
            "hit_tokens": self.hit_tokens,
            "cacheable_tokens": self.cacheable_tokens,
            "preempted_requests": self.preempted_requests,
            "preempted_queried_tokens": self.preempted_queried_tokens,
            "preempted_hit_tokens": self.preempted_hit_tokens,
            "groups": groups,
        }

    def samples(
        self, *, registered: list[int], evicted: list[int]
    ) -> list[tuple[str, dict[str, str], float]]:
        """(name, labels, value) triples in Prometheus naming (counters end in `_total`)."""
        ns = NAMESPACE
        out: list[tuple[str, dict[str, str], float]] = [
            (f"{ns}:prefix_cache_queries_total", {}, self.queried_tokens),
            (f"{ns}:prefix_cache_hits_total", {}, self.hit_tokens),
            (f"{ns}:prefix_cache_preempted_queries_total", {}, self.preempted_queried_tokens),
            (f"{ns}:prefix_cache_preempted_hits_total", {}, self.preempted_hit_tokens),
            (f"{ns}:hybrid_cacheable_tokens_total", {}, self.cacheable_tokens),
            (f"{ns}:hybrid_reconciled_hit_tokens_total", {}, self.hit_tokens),
        ]
        for g, kind in enumerate(self.group_kinds):
            labels = {"group": str(g), "kind": kind}
            out += [
                (f"{ns}:hybrid_group_hit_tokens_total", labels, self.group_offered_tokens[g]),
                (f"{ns}:hybrid_group_limiting_total", labels, self.group_limiting[g]),
                (f"{ns}:hybrid_group_registered_blocks_total", labels, registered[g]),
                (f"{ns}:hybrid_group_evicted_blocks_total", labels, evicted[g]),
            ]
        return out
