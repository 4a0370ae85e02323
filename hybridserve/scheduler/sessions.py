"""Sessions: the observed gaps between a turn's end and its session's next turn (tool time),
and the TTL a finished turn's pinned prefix gets from them.

The TTL is a high quantile of the observed gaps, capped: a session with enough gaps of its own
uses its own, else every session's recent gaps; before any gap is seen it is the cap. Gaps are
observed whether or not the pin was still held (a pin that expired must not bias the quantile
towards short gaps).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque

GLOBAL_WINDOW = 512  # recent gaps over all sessions
SESSION_WINDOW = 32  # recent gaps of one session
SESSION_MIN_GAPS = 4  # a session's own gaps are used from this many on
# Sessions remembered, oldest forgotten first. Keys are fixed-size digests
# (`Request.session_key`), so the tables are bounded in bytes, not only in entries: about
# 1.7 KB a session with its gap window and 0.16 KB a finished turn, ~24 MiB at most in all.
MAX_SESSIONS = 8_192  # sessions with a gap window of their own
MAX_FINISHED = 65_536  # sessions whose last turn's end is remembered


class ToolGapModel:
    """Online gap statistics per session and overall."""

    def __init__(self, *, quantile: float, cap_s: float) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile={quantile}; use a value in (0, 1]")
        if not cap_s > 0:
            raise ValueError(f"cap_s={cap_s}; use a positive number of seconds")
        self.quantile = quantile
        self.cap_s = cap_s
        self._all: deque[float] = deque(maxlen=GLOBAL_WINDOW)
        self._sessions: OrderedDict[str, deque[float]] = OrderedDict()
        self._finished_at: OrderedDict[str, float] = OrderedDict()

    def on_finish(self, session_id: str, time_s: float) -> None:
        """A turn of `session_id` finished at `time_s`."""
        self._finished_at[session_id] = time_s
        self._finished_at.move_to_end(session_id)
        if len(self._finished_at) > MAX_FINISHED:
            self._finished_at.popitem(last=False)

    def on_arrival(self, session_id: str, time_s: float) -> float | None:
        """The session's next turn arrived at `time_s`; returns the gap observed, if any."""
        finished = self._finished_at.pop(session_id, None)
        if finished is None:
            return None
        gap = max(time_s - finished, 0.0)
        self._all.append(gap)
        own = self._sessions.get(session_id)
        if own is None:
            own = self._sessions[session_id] = deque(maxlen=SESSION_WINDOW)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        own.append(gap)
        return gap

    def ttl(self, session_id: str) -> float:
        """Seconds to pin a finished turn of `session_id`: the gap quantile, capped."""
        own = self._sessions.get(session_id)
        gaps = own if own is not None and len(own) >= SESSION_MIN_GAPS else self._all
        if not gaps:
            return self.cap_s
        return min(_quantile(gaps, self.quantile), self.cap_s)


def _quantile(values: deque[float], q: float) -> float:
    """The nearest-rank q-quantile (the smallest value with at least q of them at or below)."""
    ordered = sorted(values)
    rank = max(math.ceil(q * len(ordered)), 1)
    return ordered[rank - 1]
