"""The cache-in-code snippet of docs/cache.md runs as written: it builds the Qwen3-Next-style
layout, admits a 10,000-token prompt with no hit on an empty cache, records that lookup once
at admission, and frees it with the cache's invariants intact."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = (Path(__file__).resolve().parents[2] / "docs" / "cache.md").read_text()


def test_the_cache_in_code_snippet_runs_and_leaves_a_consistent_cache() -> None:
    (snippet,) = [
        block
        for block in re.findall(r"```python\n(.*?)```", PAGE, flags=re.DOTALL)
        if "KVCacheManager(layout)" in block
    ]
    names: dict[str, object] = {}
    exec(compile(snippet, "docs/cache.md", "exec"), names)
    assert names["hit"].num_tokens == 0  # type: ignore[attr-defined]
    metrics = names["cache"].metrics_snapshot()  # type: ignore[attr-defined]
    assert (metrics["requests"], metrics["queried_tokens"]) == (1, 10_000)
    assert [g["kind"] for g in metrics["groups"]] == ["full", "mamba"]
