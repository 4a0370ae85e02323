"""Mooncake-format traces: load, validate, synthesise token ids, and a built-in agent trace.

A Mooncake record is `{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}`
with one hash id per 512-token block: equal ids are equal blocks. Token ids are synthesised so
that two blocks share tokens exactly when they share a hash id, so any block size dividing 512
sees the same prefix structure.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hybridserve.core.errors import HybridServeError

TRACE_BLOCK_TOKENS = 512
_OUTPUT_BASE = 1 << 40  # output tokens live above every synthesised prompt token


class TraceError(HybridServeError, ValueError):
    """A trace file is missing or malformed; the message names the line and field."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    index: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def prompt_tokens(self) -> list[int]:
        """Token j of a block with hash id h is h*512 + j; the last block may be partial."""
        out: list[int] = []
        for h in self.hash_ids:
            start = h * TRACE_BLOCK_TOKENS
            out.extend(range(start, start + TRACE_BLOCK_TOKENS))
        del out[self.input_length :]
        return out

    def output_tokens(self) -> list[int]:
        """Unique to this request: outputs never create accidental prefix sharing."""
        base = _OUTPUT_BASE + self.index * (1 << 24)
        return list(range(base, base + self.output_length))


def read_text_lines(path: Path, *, what: str, hint: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of each line of a UTF-8 file. Raises TraceError for a
    missing file (with `hint`, how to name the right one) and for bytes that are not UTF-8
    (naming the line and the byte offset)."""
    if not path.is_file():
        state = "is not a file" if path.exists() else "does not exist"
        raise TraceError(f"{what} {path} {state}; {hint}")
    offset = 0
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceError(
                    f"{path}:{lineno}: byte {offset + exc.start} (column {exc.start + 1}) is not "
                    f"UTF-8 ({raw[exc.start : exc.start + 1]!r}); the file must be UTF-8 text: "
                    "re-export or re-copy it"
                ) from None
            offset += len(raw)
            yield lineno, text


def load_mooncake(
    path: Path,
    *,
    limit: int | None = None,
    hint: str = "pass --trace PATH to a Mooncake JSONL",
) -> list[TraceRecord]:
    """Read a Mooncake JSONL trace. Raises TraceError naming the line and field; a missing
    file's error ends with `hint` (the option that names the trace)."""
    records: list[TraceRecord] = []
    for lineno, line in read_text_lines(path, what="trace", hint=hint):
        if limit is not None and len(records) >= limit:
            break
        if not line.strip():
            continue
        records.append(_parse_line(path, lineno, line, len(records)))
    if not records:
        raise TraceError(f"trace {path} holds no records")
    records.sort(key=lambda r: (r.timestamp_ms, r.index))
    return records


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_line(path: Path, lineno: int, line: str, index: int) -> TraceRecord:
    where = f"{path}:{lineno}"
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg}, column {exc.colno})") from None
    if not isinstance(raw, dict):
        raise TraceError(f"{where}: expected a JSON object per line")
    for field in ("timestamp", "input_length", "output_length", "hash_ids"):
        if field not in raw:
            raise TraceError(f"{where}: field {field!r} is missing")
    length, out, ids = raw["input_length"], raw["output_length"], raw["hash_ids"]
    if not _is_int(length) or length < 1:
        raise TraceError(f"{where}: input_length={length!r}; use a positive integer")
    if not _is_int(out) or out < 0:
        raise TraceError(f"{where}: output_length={out!r}; use an integer >= 0")
    if not isinstance(ids, list) or not all(_is_int(h) and h >= 0 for h in ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers >= 0")
    expected = -(-length // TRACE_BLOCK_TOKENS)
    if len(ids) != expected:
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for input_length={length}; "
            f"a {TRACE_BLOCK_TOKENS}-token block trace needs {expected}"
        )
    stamp = raw["timestamp"]
    if not isinstance(stamp, int | float) or isinstance(stamp, bool):
        raise TraceError(f"{where}: timestamp={stamp!r}; use milliseconds")
    if not math.isfinite(stamp) or stamp < 0:
        raise TraceError(f"{where}: timestamp={stamp!r}; use a finite number of milliseconds >= 0")
    return TraceRecord(index, float(stamp), length, out, tuple(ids))


def synthetic_agent_trace(
    *, num_agents: int = 8, turns: int = 6, seed: int = 0
) -> list[TraceRecord]:
    """A small built-in trace: agents share a system prompt and grow their own context.

    Each turn resends the agent's whole history (shared prompt, task, earlier turns) plus a new
    tool result, as coding agents do; used when no trace file is available.
    """
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    system = fresh(24)  # a 12k-token shared system + tool prompt
    histories = [system + fresh(rng.randint(1, 4)) for _ in range(num_agents)]
    records: list[TraceRecord] = []
    for turn in range(turns):
        for agent in range(num_agents):
            history = histories[agent]
            tail = rng.randint(1, TRACE_BLOCK_TOKENS)
            length = (len(history) - 1) * TRACE_BLOCK_TOKENS + tail
            timestamp = turn * 20_000.0 + agent * 500.0
            records.append(
                TraceRecord(len(records), timestamp, length, rng.randint(50, 600), tuple(history))
            )
            histories[agent] = history + fresh(rng.randint(1, 6))
    return records
