"""Clocks. The core never reads the wall clock itself: time is passed in."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since an arbitrary origin."""
        ...


class ManualClock:
    """A clock that moves only when told to; the simulator and tests use it."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"seconds={seconds} is negative; a clock never goes back")
        self._now += seconds


class WallClock:
    """Monotonic wall time, for the server and the torch executor."""

    def now(self) -> float:
        return time.monotonic()
