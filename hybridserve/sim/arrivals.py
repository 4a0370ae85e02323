"""Open-loop workloads for the simulator: Mooncake and Azure traces, and Poisson arrivals.

Each yields (arrival seconds, request id, prompt token ids, max output tokens). Mooncake prompts
are synthesised from hash ids (blocks share tokens exactly when they share a hash id), so prefix
reuse is the trace's own; Azure traces carry lengths only, so their prompts share nothing.
`time_scale` multiplies arrival times (0.5 = twice the load); `limit` keeps the first requests.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from hybridserve.cache_replay.trace import TraceError, load_mooncake
from hybridserve.core.errors import ConfigError

ArrivalTuple = tuple[float, str, list[int], int]
_UNIQUE_BASE = 1 << 40


def mooncake_arrivals(
    path: Path, *, time_scale: float = 1.0, limit: int | None = None
) -> Iterator[ArrivalTuple]:
    _check_scale(time_scale)
    for record in load_mooncake(path, limit=limit):
        yield (
            record.timestamp_ms / 1000.0 * time_scale,
            f"m{record.index}",
            record.prompt_tokens(),
            max(record.output_length, 1),
        )


def azure_arrivals(
    path: Path, *, time_scale: float = 1.0, limit: int | None = None
) -> Iterator[ArrivalTuple]:
    """Azure LLM inference trace CSV: TIMESTAMP, ContextTokens, GeneratedTokens."""
    _check_scale(time_scale)
    if not path.exists():
        raise TraceError(f"trace {path} does not exist; pass azure:PATH to the CSV")
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        start: datetime | None = None
        for index, row in enumerate(reader):
            if limit is not None and index >= limit:
                return
            try:
                stamp = datetime.fromisoformat(row["TIMESTAMP"][:26])
                context, generated = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (KeyError, ValueError) as exc:
                raise TraceError(f"{path}: row {index + 2} is malformed ({exc})") from None
            start = start or stamp
            base = _UNIQUE_BASE + index * (1 << 20)
            prompt = list(range(base, base + max(context, 1)))
            offset = (stamp - start).total_seconds() * time_scale
            yield (offset, f"a{index}", prompt, max(generated, 1))


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
