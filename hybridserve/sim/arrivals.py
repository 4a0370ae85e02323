"""Open-loop workloads for the simulator: Mooncake and Azure traces, and Poisson arrivals.

Each yields (arrival seconds, request id, prompt token ids, max output tokens). Mooncake prompts
are synthesised from hash ids (blocks share tokens exactly when they share a hash id), so prefix
reuse is the trace's own; Azure traces carry lengths only, so their prompts share nothing.
`time_scale` multiplies arrival times (0.5 = twice the load); `limit` keeps the first requests.

A malformed line refuses the whole trace with an error naming the file, the line and the field
(as `cache_replay.trace` does). A well-formed request whose prompt does not fit
`max_prompt_tokens` (the run's max_model_len) is the engine's to refuse, so it is refused the same
way: appended to `rejected` (id, prompt tokens, reason) and skipped, before its prompt is built.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from hybridserve.cache_replay.trace import TraceError, load_mooncake, read_text_lines
from hybridserve.core.errors import ConfigError

ArrivalTuple = tuple[float, str, list[int], int]
# A request refused before it ran: its id, its prompt length and why (the engine's words).
Rejected = tuple[str, int, str]
_UNIQUE_BASE = 1 << 40
# Each synthesised Azure prompt owns 2^20 token ids: a longer one would share tokens with the
# next request's prompt, so no Azure prompt may be longer, whatever max_model_len allows.
AZURE_MAX_PROMPT_TOKENS = 1 << 20
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def mooncake_arrivals(
    path: Path,
    *,
    time_scale: float = 1.0,
    limit: int | None = None,
    max_prompt_tokens: int | None = None,
    rejected: list[Rejected] | None = None,
) -> Iterator[ArrivalTuple]:
    _check_scale(time_scale)
    hint = "pass --workload mooncake:PATH with the path of a Mooncake JSONL trace"
    for record in load_mooncake(path, limit=limit, hint=hint):
        req_id = f"m{record.index}"
        where = f"{path}: request {record.index + 1} ({req_id})"
        if _too_long(where, req_id, record.input_length, max_prompt_tokens, rejected):
            continue
        yield (
            record.timestamp_ms / 1000.0 * time_scale,
            req_id,
            record.prompt_tokens(),
            max(record.output_length, 1),
        )


def azure_arrivals(
    path: Path,
    *,
    time_scale: float = 1.0,
    limit: int | None = None,
    max_prompt_tokens: int | None = None,
    rejected: list[Rejected] | None = None,
) -> Iterator[ArrivalTuple]:
    """Azure LLM inference trace CSV: TIMESTAMP, ContextTokens, GeneratedTokens."""
    _check_scale(time_scale)
    hint = "pass --workload azure:PATH with the path of an Azure trace CSV"
    lines = (text for _, text in read_text_lines(path, what="trace", hint=hint))
    reader = csv.DictReader(lines)
    missing = [c for c in _AZURE_COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise TraceError(
            f"{path}:1: the header has no column {missing[0]!r}; an Azure trace starts with "
            f"the line {','.join(_AZURE_COLUMNS)}"
        )
    limit_tokens = min(max_prompt_tokens or AZURE_MAX_PROMPT_TOKENS, AZURE_MAX_PROMPT_TOKENS)
    start: datetime | None = None
    for index, row in enumerate(reader):
        if limit is not None and index >= limit:
            return
        stamp, context, generated = _azure_row(path, reader.line_num, row)
        start = start or stamp
        req_id = f"a{index}"
        if _too_long(f"{path}:{reader.line_num}", req_id, context, limit_tokens, rejected):
            continue
        base = _UNIQUE_BASE + index * AZURE_MAX_PROMPT_TOKENS
        offset = (stamp - start).total_seconds() * time_scale
        yield (offset, req_id, list(range(base, base + context)), max(generated, 1))


def _azure_row(path: Path, lineno: int, row: dict[str, str | None]) -> tuple[datetime, int, int]:
    """(timestamp, context tokens, generated tokens) of one row, checked as the Mooncake
    loader checks its lines: a prompt of 1 or more tokens, 0 or more generated."""
    where = f"{path}:{lineno}"
    text = row.get("TIMESTAMP")
    try:
        stamp = datetime.fromisoformat((text or "")[:26])
    except ValueError:
        raise TraceError(
            f"{where}: TIMESTAMP={text!r}; use an ISO time such as 2023-11-16 18:17:03.979"
        ) from None
    counts = []
    for column, least in (("ContextTokens", 1), ("GeneratedTokens", 0)):
        value = row.get(column)
        try:
            number = int(value or "")
        except ValueError:
            number = None
        if number is None or number < least:
            raise TraceError(f"{where}: {column}={value!r}; use an integer >= {least}")
        counts.append(number)
    return stamp, counts[0], counts[1]


def _too_long(
    where: str,
    req_id: str,
    tokens: int,
    max_prompt_tokens: int | None,
    rejected: list[Rejected] | None,
) -> bool:
    """True when the prompt cannot run: recorded in `rejected`, or, without a list to record
    it in, an error (a prompt is never built past the limit)."""
    if max_prompt_tokens is None or tokens < max_prompt_tokens:
        return False
    if max_prompt_tokens >= AZURE_MAX_PROMPT_TOKENS and req_id.startswith("a"):
        reason = (
            f"an Azure prompt holds fewer than {AZURE_MAX_PROMPT_TOKENS:,} tokens "
            "(synthesised prompts would overlap)"
        )
    else:
        reason = f"max_model_len={max_prompt_tokens} leaves no room to generate"
    if rejected is None:
        raise TraceError(f"{where}: a {tokens:,}-token prompt; {reason}: shorten it or drop it")
    rejected.append((req_id, tokens, reason))
    return True


def poisson_arrivals(
    *,
    rate_per_s: float,
    num_requests: int,
    input_tokens: int,
    output_tokens: int,
    seed: int,
) -> Iterator[ArrivalTuple]:
    """Fixed-length requests with exponential inter-arrival times."""
    if rate_per_s <= 0:
        raise ConfigError("rate", rate_per_s, "use a positive request rate")
    rng = random.Random(seed)
    now = 0.0
    for index in range(num_requests):
        now += rng.expovariate(rate_per_s)
        base = _UNIQUE_BASE + index * (1 << 20)
        yield (now, f"p{index}", list(range(base, base + input_tokens)), output_tokens)


def _check_scale(time_scale: float) -> None:
    if time_scale <= 0:
        raise ConfigError("time_scale", time_scale, "use a positive factor")
