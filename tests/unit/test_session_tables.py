"""The tool-gap model's session tables stay bounded in bytes, whatever the clients send."""

from __future__ import annotations

import gc
import sys
import time

from hybridserve.core.request import session_key
from hybridserve.scheduler.sessions import (
    MAX_FINISHED,
    MAX_SESSIONS,
    SESSION_WINDOW,
    ToolGapModel,
)


def _deep_size(root: object) -> int:
    """Bytes of `root` and every object it reaches (each counted once)."""
    seen: set[int] = set()
    stack = [root]
    total = 0
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, type):
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        stack.extend(gc.get_referents(item))
    return total


def _filled(num_sessions: int, num_finished: int) -> ToolGapModel:
    """A model with `num_sessions` full gap windows and `num_finished` turns awaiting return,
    every key from a long id (the key is a digest)."""
    model = ToolGapModel(quantile=0.9, cap_s=30.0)
    now = 0.0
    for i in range(num_sessions):
        key = session_key("tenant", f"{i:x}" * 1000)
        for _ in range(SESSION_WINDOW):
            model.on_finish(key, now)
            now += 1.0
            model.on_arrival(key, now)
    for i in range(num_finished):
        model.on_finish(session_key(None, f"waiting-{i}" * 1000), now)
    return model


def test_the_gap_tables_hold_under_32_mib_when_every_limit_is_reached() -> None:
    empty = _deep_size(_filled(0, 0))
    per_session = (_deep_size(_filled(500, 0)) - empty) / 500
    per_finished = (_deep_size(_filled(0, 500)) - empty) / 500
    worst = empty + MAX_SESSIONS * per_session + MAX_FINISHED * per_finished
    assert worst < 32 * 2**20, f"{worst / 2**20:.1f} MiB"
    assert per_session < 4096 and per_finished < 512  # no id is kept, only its digest


def test_a_session_forgotten_for_room_falls_back_to_the_global_gaps() -> None:
    model = ToolGapModel(quantile=1.0, cap_s=100.0)
    first = session_key(None, "first")
    for _ in range(8):
        model.on_finish(first, 0.0)
        model.on_arrival(first, 50.0)  # first's own gaps: 50 s
    assert model.ttl(first) == 50.0
    started = time.monotonic()
    for i in range(MAX_SESSIONS):
        key = session_key(None, str(i))
        model.on_finish(key, 0.0)
        model.on_arrival(key, 1.0)
    assert time.monotonic() - started < 10
    # Forgotten: the global window (recent 1 s gaps, and first's old ones rolled out).
    assert model.ttl(first) == 1.0
