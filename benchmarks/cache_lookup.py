"""Admission-lookup cost for a 128k-token prompt on a 3-group layout, metrics on vs off.

Prints one JSON object. The layout is full attention + sliding window (w=4096) + Mamba
(align), 16-token blocks, EAGLE, boundary+predecessor retention. The cache is warmed with a
128k-token prompt; each sample is one admission of an extending request: the reconciled lookup
(with its metrics staged), then allocation and registration (which commits them), then free.
On and off runs alternate so that machine noise hits both alike; figures are medians.
"""

from __future__ import annotations

import json
import statistics
import time

from hybridserve.core.config import SpeculativeConfig
from hybridserve.kvcache import (
    CacheLayout,
    FullAttentionSpec,
    KVCacheManager,
    MambaSpec,
    Retention,
    SlidingWindowSpec,
)

PROMPT_TOKENS = 128 * 1024
REPEATS = 30


def build(enable_metrics: bool) -> tuple[KVCacheManager, list[bytes], int]:
    layout = CacheLayout(
        groups=(
            FullAttentionSpec(block_size=16),
            SlidingWindowSpec(block_size=16, window=4096),
            MambaSpec(block_size=16),
        ),
        num_blocks=40_000,
        speculative=SpeculativeConfig.from_name("eagle"),
        retention=Retention.parse("boundary+predecessor"),
    )
    manager = KVCacheManager(layout, enable_metrics=enable_metrics)
    warm = list(range(PROMPT_TOKENS))
    hashes = manager.hasher.hash_tokens(warm)
    manager.new_step()
    hit = manager.find_hit(hashes, len(warm))
    position = 0
    for index, end in enumerate((*manager.planned_checkpoints(len(warm), hit), len(warm))):
        manager.new_step()
        manager.allocate(
            "warm",
            hashes,
            num_tokens=len(warm),
            num_computed_tokens=position,
            num_new_tokens=end - position,
            hit=hit if index == 0 else None,
            num_prompt_tokens=len(warm),
        )
        position = end
    manager.free("warm")
    turn = warm + list(range(10**9, 10**9 + 2048))
    manager.new_step()
    return manager, manager.hasher.hash_tokens(turn), len(turn)


def lookup_us(manager: KVCacheManager, hashes: list[bytes], num_tokens: int) -> float:
    start = time.perf_counter()
    manager.find_hit(hashes, num_tokens)
    return (time.perf_counter() - start) * 1e6


def admission_us(
    manager: KVCacheManager, hashes: list[bytes], num_tokens: int
) -> tuple[float, int]:
    start = time.perf_counter()
    hit = manager.find_hit(hashes, num_tokens)
    manager.allocate(
        "turn",
        hashes,
        num_tokens=num_tokens,
        num_computed_tokens=0,
        num_new_tokens=num_tokens - hit.num_tokens,
        hit=hit,
        num_prompt_tokens=num_tokens,
    )
    elapsed = (time.perf_counter() - start) * 1e6
    manager.free("turn")
    manager.new_step()
    return elapsed, hit.num_tokens


def main() -> None:
    on = build(enable_metrics=True)
    off = build(enable_metrics=False)
    samples: dict[str, list[float]] = {"on": [], "off": [], "lookup_on": [], "lookup_off": []}
    hit_tokens = 0
    for _ in range(REPEATS):
        for name, (manager, hashes, n) in (("on", on), ("off", off)):
            samples[f"lookup_{name}"].append(lookup_us(manager, hashes, n))
            elapsed, hit_tokens = admission_us(manager, hashes, n)
            samples[name].append(elapsed)
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(
        json.dumps(
            {
                "benchmark": "cache_lookup",
                "prompt_tokens": on[2],
                "layout": "full:16 + swa:16:w=4096 + mamba:16 (align), eagle, boundary+predecessor",
                "hit_tokens": hit_tokens,
                "repeats": REPEATS,
                "lookup_us_metrics_on": round(med["lookup_on"], 1),
                "lookup_us_metrics_off": round(med["lookup_off"], 1),
                "admission_us_metrics_on": round(med["on"], 1),
                "admission_us_metrics_off": round(med["off"], 1),
                "metrics_overhead_lookup": round(med["lookup_on"] / med["lookup_off"] - 1, 4),
                "metrics_overhead_admission": round(med["on"] / med["off"] - 1, 4),
                "goal": "metrics overhead < 0.05",
            }
        )
    )


if __name__ == "__main__":
    main()
