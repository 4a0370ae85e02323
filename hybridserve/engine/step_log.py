"""A step log: one JSON line per engine step, written by the server (`serve --step-log`) and by
the simulator (`simulate --step-log`) in the same form, so a real engine's schedule and step
times can be set beside a simulated twin's, step by step.

Each line: `t` (when the step began, seconds on the engine's clock: the server's since it
started, the simulator's simulated time), `s` (the step's seconds: the server's wall time of
schedule + execute + update, the simulator's charged time), `exec_s` (the seconds the executor
reported: a torch executor's own share, a simulated executor's modelled time),
`chunks` (per scheduled request `[new tokens, context tokens before them, draft tokens]`, in
the scheduler's order), `running` and `waiting` (after scheduling), `preempted` (requests
preempted to make room), `shared` (context tokens of the step's decodes in full-attention
blocks another decode of the step reads too, once per extra reader: a shared system prompt;
`hybridserve.engine.shared_kv`; 0 in a log written without the cache layout). A step that
scheduled nothing is not logged.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hybridserve.core.errors import ConfigError
from hybridserve.engine.engine import EngineStep
from hybridserve.engine.shared_kv import DecodeSharing
from hybridserve.kvcache import CacheLayout

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One logged step (see the module's docstring for the fields)."""

    t: float
    s: float
    exec_s: float
    chunks: tuple[tuple[int, int, int], ...]  # (new tokens, context before them, drafts)
    running: int = 0
    waiting: int = 0
    preempted: int = 0
    shared: int = 0  # StepShape.shared_kv_tokens of the step

    @property
    def num_decodes(self) -> int:
        return sum(1 for new, _, drafts in self.chunks if new <= 1 + drafts)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(new for new, _, drafts in self.chunks if new > 1 + drafts)

    @property
    def kind(self) -> str:
        """decode (every chunk a decode), prefill (none), or mixed."""
        decodes = self.num_decodes
        if decodes == len(self.chunks):
            return "decode"
        return "mixed" if decodes else "prefill"

    def to_json(self) -> dict[str, Any]:
        return {
            "t": round(self.t, 6),
            "s": round(self.s, 6),
            "exec_s": round(self.exec_s, 6),
            "chunks": [list(c) for c in self.chunks],
            "running": self.running,
            "waiting": self.waiting,
            "preempted": self.preempted,
            "shared": self.shared,
        }


def step_record(
    step: EngineStep, *, start_s: float, duration_s: float, shared: int = 0
) -> StepRecord:
    """The record of one engine step that began at `start_s` and took `duration_s`; `shared`
    its decodes' shared context tokens."""
    scheduled = step.scheduled
    chunks = tuple((c.num_tokens, c.start, c.num_draft_tokens) for c in scheduled.plan.chunks)
    return StepRecord(
        t=start_s,
        s=duration_s,
        exec_s=step.result.duration_s,
        chunks=chunks,
        running=scheduled.num_running,
        waiting=scheduled.num_waiting,
        preempted=len(scheduled.preempted),
        shared=shared,
    )


class StepLog:
    """Writes a step log to `path` (replacing it), one line per step that scheduled work.
    Lines are flushed every `flush_every` steps and on close, so a killed server leaves all
    but its last few steps. With the engine's cache `layout` (or `follow(layout)` before the
    first step) it counts each step's shared decode reads (`shared`)."""

    def __init__(
        self, path: Path, *, flush_every: int = 64, layout: CacheLayout | None = None
    ) -> None:
        try:
            self._file: IO[str] = path.open("w", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                "step log (--step-log)",
                str(path),
                f"cannot write it ({exc.strerror or exc}); pass a path in a writable folder",
            ) from None
        self.path = path
        self.flush_every = max(flush_every, 1)
        self.steps = 0
        self._sharing: DecodeSharing | None = None
        if layout is not None:
            self.follow(layout)

    def follow(self, layout: CacheLayout) -> None:
        """Count shared decode reads over `layout`'s first full-attention group."""
        self._sharing = DecodeSharing.of(layout)

    def write(self, step: EngineStep, *, start_s: float, duration_s: float) -> None:
        """Log one step. A log that cannot be written (a full disk) is closed with a warning:
        it never stops the engine."""
        plan = step.scheduled.plan
        # Every plan is followed (a step of no chunks may still finish requests).
        shared = self._sharing.shared_kv_tokens(plan) if self._sharing is not None else 0
        if not plan.chunks or self._file.closed:
            return
        record = step_record(step, start_s=start_s, duration_s=duration_s, shared=shared)
        try:
            self._file.write(json.dumps(record.to_json(), separators=(",", ":")) + "\n")
            self.steps += 1
            if self.steps % self.flush_every == 0:
                self._file.flush()
        except OSError as exc:
            logger.warning("step log %s: %s; no more steps are logged", self.path, exc)
            self._close_quietly()

    def _close_quietly(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()

    def close(self) -> None:
        if not self._file.closed:
            self._close_quietly()

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_step_log(path: Path) -> list[StepRecord]:
    """The records of a step log; a line that is not a step record is an error naming it (a
    last line cut short by a killed writer is skipped)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        why = f"cannot read it ({exc.strerror or exc})"
        raise ConfigError("step log", str(path), why) from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(_record(json.loads(line)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            if number == len(lines):  # the writer was killed mid-line
                break
            raise ConfigError(
                f"step log {path} line {number}",
                line[:80],
                f"not a step record ({exc}); pass a file written by --step-log",
            ) from None
    return records


def _record(data: Any) -> StepRecord:
    chunks = tuple((int(n), int(c), int(d)) for n, c, d in data["chunks"])
    return StepRecord(
        t=float(data["t"]),
        s=float(data["s"]),
        exec_s=float(data["exec_s"]),
        chunks=chunks,
        running=int(data.get("running", 0)),
        waiting=int(data.get("waiting", 0)),
        preempted=int(data.get("preempted", 0)),
        shared=int(data.get("shared", 0)),
    )
