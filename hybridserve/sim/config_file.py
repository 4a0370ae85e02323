"""`--config FILE.toml`: engine limits, scheduler controls and cache retention for a run.

```toml
[scheduler]                 # any SchedulerConfig field; applied on top of the preset
max_num_batched_tokens = 8192
max_num_prefill_tokens_per_step = 2176
max_num_partial_prefills = 2
decode_prefill_min_decode_steps = 2
decode_prefill_max_wait_ms = 2000.0
target_mixed_step_ms = 0.0
policy = "fcfs"

[cache]
retention = "boundary+predecessor"   # dense | boundary | boundary+predecessor | interval:N
```
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hybridserve.core.config import SchedulerConfig, SchedulingPolicy
from hybridserve.core.errors import ConfigError
from hybridserve.kvcache import RetentionPolicy

_SCHEDULER_FIELDS = {f.name: f for f in fields(SchedulerConfig)}
_TABLES = ("scheduler", "cache")


@dataclass(frozen=True, slots=True)
class FileConfig:
    scheduler: tuple[tuple[str, Any], ...]  # SchedulerConfig overrides, in file order
    retention: str | None


def load_config_file(path: Path) -> FileConfig:
    """Read and validate a run's TOML file. Raises ConfigError naming the key and the fix."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError("config", str(path), f"give a readable TOML file ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", str(path), f"fix the TOML syntax: {exc}") from None
    unknown = set(data) - set(_TABLES)
    if unknown:
        raise ConfigError("config", sorted(unknown), f"use the tables {list(_TABLES)}")
    scheduler = data.get("scheduler", {})
    overrides: list[tuple[str, Any]] = []
    for key, value in scheduler.items():
        field = _SCHEDULER_FIELDS.get(key)
        if field is None:
            raise ConfigError(f"scheduler.{key}", value, f"use one of {sorted(_SCHEDULER_FIELDS)}")
        overrides.append((key, _coerce(key, value)))
    cache = data.get("cache", {})
    unknown_cache = set(cache) - {"retention"}
    if unknown_cache:
        key = sorted(unknown_cache)[0]
        raise ConfigError(f"cache.{key}", cache[key], "the cache table takes only retention")
    retention = cache.get("retention")
    if retention is not None:
        if not isinstance(retention, str):
            raise ConfigError("cache.retention", retention, "write it as a string")
        RetentionPolicy.parse(retention)  # validates, with its own clear error
    # Validate the combination now, not in the middle of a run.
    SchedulerConfig(**dict(overrides))
    return FileConfig(tuple(overrides), retention)


def _coerce(key: str, value: Any) -> Any:
    expected = _SCHEDULER_FIELDS[key].default
    if key == "policy":
        try:
            return SchedulingPolicy(value)
        except ValueError:
            raise ConfigError(
                "scheduler.policy", value, f"use one of {[p.value for p in SchedulingPolicy]}"
            ) from None
    if isinstance(expected, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"scheduler.{key}", value, "write true or false")
        return value
    if isinstance(expected, int) and not isinstance(expected, bool):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"scheduler.{key}", value, "write a whole number")
        return value
    if isinstance(expected, float):
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(f"scheduler.{key}", value, "write a number")
        return float(value)
    return value
