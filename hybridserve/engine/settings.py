"""Where an engine's settings come from: the presets, the one settings file, and their order.

Every command that builds an engine (`simulate`, `bench`, `sweep`, `serve`, `generate`) resolves
its scheduler settings and cache retention the same way: the preset, then the `--config` TOML
file, then the flags given on the command line (a later layer wins, field by field).

The file (`--config FILE.toml`):

```toml
preset = "baseline"                  # optional: the preset the file builds on

[scheduler]                          # any SchedulerConfig field
max_num_batched_tokens = 8192
max_num_prefill_tokens_per_step = 2176
max_num_partial_prefills = 2
decode_prefill_min_decode_steps = 2
policy = "fcfs"

[cache]
retention = "boundary+predecessor"   # dense | boundary | boundary+predecessor | interval:N
```

A top-level `retention` (the form `serve` read before) is still accepted, with a deprecation
message naming `[cache] retention`. Errors name the key, the value and the fix.

The presets:

* `baseline`: vLLM 0.33 exactly - every scheduler control off, vLLM's `boundary` retention,
  lookahead block hashes under EAGLE/MTP (no block dropped).
* `legacy`: the pre-0.33 engine of the E1 story - every control off, EAGLE/MTP drop the last
  matched block of a prefix hit instead of hashing a lookahead, and Mamba states are kept only at
  floor((L-1)/A)*A (`boundary-only`), so a dropped lookup finds no state.
* `hybridserve` (the default): vLLM 0.33 (`baseline`, its 8,192-token budget as the ceiling)
  with the adaptive prefill budget (the prefill of a step that carries decodes follows measured
  step times towards 60 ms while nothing in prefill waits, rising to 75 ms as the oldest wait
  reaches 1 s; once it has waited 2 s it grows towards steps of 88 ms), the first-token
  deadline (a request that has waited 12 s goes behind those that can still meet the 15 s TTFT
  SLO), `max_num_seqs` 512, tool-call TTL pinning of at most half the
  pool (`kv_pin_fraction` 0.5) and exact tails (`kv_pin_exact_tail`: a session's next turn
  resumes where its last one ended, not at the last retained block boundary). Chosen on the
  workload suite's `choose` rows and checked on the rest (docs/suite.md). A request without a
  session id is never pinned.
* `fixed-budget`: the shipped preset before the suite: vLLM 0.33 with the 2,048-token budget a
  search of vLLM's own knobs found for 20 agents (`docs/sweep_vllm_e1_20_agents.json`),
  `max_num_seqs` 512, pinning and exact tails. It wins on agents and loses badly on long-prompt
  traces and prefill-heavy loads.
* `decode-first`: the controls an earlier sweep picked for p99 ITL (Cp = 16 quanta, Mp = 2,
  D = 4, T = 60 ms, no deadline) with `boundary+predecessor` retention; the `hybridserve`
  preset until it lost jobs past 20 agents by queueing the prefills that start turns.
* `controls-only` and `retention-only`: the two ablations of `decode-first`.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from hybridserve.core.config import SchedulerConfig
from hybridserve.core.errors import ConfigError
from hybridserve.kvcache import Retention

PRESETS = (
    "baseline",
    "legacy",
    "hybridserve",
    "fixed-budget",
    "decode-first",
    "controls-only",
    "retention-only",
)
# The shipped preset's adaptive prefill budget (hybridserve/scheduler/adaptive.py), chosen on
# the workload suite's `choose` rows (docs/suite.md): steps that carry decodes aim at 75 ms;
# once the oldest prefill has waited 2 s the budget grows back towards vLLM's 8,192 tokens, but
# never past steps of 88 ms (the 100 ms p99 ITL SLO less a margin for the p99). While nothing
# in prefill has waited, steps aim at 60 ms instead (about what the tuned vLLM's 2,048-token
# steps take), rising to 75 ms as the oldest wait reaches 1 s: a short queue costs no gap.
ADAPTIVE_ITL_MS = 75.0
ADAPTIVE_QUEUE_MS = 2_000.0
ADAPTIVE_PRESSURE_ITL_MS = 88.0
ADAPTIVE_CALM_ITL_MS = 60.0
# The waiting queue's first-token deadline (scheduler/queue.py DeadlineQueue): the 15 s TTFT SLO
# (DESIGN.md section 6) less a fifth for the prefill still to come once a request is admitted. A
# request that has waited that long goes behind those that can still meet the SLO.
WAITING_DEADLINE_MS = 12_000.0
DEFAULT_PRESET = "hybridserve"


@dataclass(frozen=True, kw_only=True, slots=True)
class Preset:
    scheduler: SchedulerConfig
    retention: Retention
    # False: EAGLE/MTP use the legacy one-block drop instead of lookahead block hashes.
    lookahead_block_hashes: bool = True


def preset_uses_lookahead(name: str) -> bool:
    """False for the `legacy` preset: EAGLE/MTP drop a block instead of hashing a lookahead."""
    return name != "legacy"


def preset(name: str, *, quantum: int, max_model_len: int) -> Preset:
    """The named configuration; controls in multiples of the quantum (the state block).

    `controls-only` and `retention-only` are the two ablations of `decode-first`. A model
    without state groups has q = 1 (SPEC.md 5.2); its mixed-prefill cap is then 8,192 tokens,
    about what 16 quanta are on the hybrid model the preset was selected on (8,704).
    """
    if name not in PRESETS:
        raise ConfigError("preset", name, f"use one of {PRESETS}")
    controls = name in ("decode-first", "controls-only")
    predecessor = name in ("decode-first", "retention-only")
    scheduler = SchedulerConfig(max_model_len=max_model_len)
    if name == "hybridserve":
        scheduler = SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=512,
            adaptive_budget_itl_ms=ADAPTIVE_ITL_MS,
            adaptive_budget_queue_ms=ADAPTIVE_QUEUE_MS,
            adaptive_budget_pressure_itl_ms=ADAPTIVE_PRESSURE_ITL_MS,
            adaptive_budget_calm_itl_ms=ADAPTIVE_CALM_ITL_MS,
            adaptive_budget_context_weight=True,
            waiting_deadline_ms=WAITING_DEADLINE_MS,
            kv_pin_fraction=0.5,
            kv_pin_exact_tail=True,
        )
    if name == "fixed-budget":  # the shipped preset before the suite: chosen on E1 alone
        scheduler = SchedulerConfig(
            max_model_len=max_model_len,
            max_num_batched_tokens=2_048,
            max_num_seqs=512,
            kv_pin_fraction=0.5,
            kv_pin_exact_tail=True,
        )
    if controls:
        scheduler = SchedulerConfig(
            max_model_len=max_model_len,
            max_num_prefill_tokens_per_step=16 * quantum if quantum > 1 else 8_192,
            max_num_partial_prefills=2,
            decode_prefill_min_decode_steps=4,
            target_mixed_step_ms=60.0,
        )
    if predecessor:
        retention = Retention.parse("boundary+predecessor")
    elif name == "legacy":
        retention = Retention.parse("boundary-only")
    else:
        retention = Retention.parse("boundary")
    return Preset(
        scheduler=scheduler, retention=retention, lookahead_block_hashes=preset_uses_lookahead(name)
    )


# ----- the settings file ------------------------------------------------------------------------

_SCHEDULER_FIELDS = {f.name: f for f in fields(SchedulerConfig)}
_TOP_LEVEL = ("preset", "scheduler", "cache")
_DEPRECATED_RETENTION = (
    "a top-level `retention` is deprecated and will be refused in the next release; write it "
    "as `[cache]` `retention = {value!r}`"
)


@dataclass(frozen=True, slots=True)
class SettingsFile:
    """A validated `--config` file: what it sets, in file order, and nothing it does not."""

    preset: str | None = None
    scheduler: tuple[tuple[str, Any], ...] = ()  # SchedulerConfig fields, in file order
    retention: str | None = None
    # Old spellings the file used, each with its new one (to print as warnings).
    deprecations: tuple[str, ...] = ()


def load_settings_file(path: Path) -> SettingsFile:
    """Read and validate a `--config` TOML file. Raises ConfigError naming the key, the value
    and the fix."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError("config", str(path), f"give a readable TOML file ({exc})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("config", str(path), f"fix the TOML syntax: {exc}") from None
    return parse_settings(data)


def parse_settings(data: Mapping[str, Any]) -> SettingsFile:
    """The settings of a parsed TOML document (see `load_settings_file`)."""
    deprecations: list[str] = []
    data = dict(data)
    old_retention = data.pop("retention", None)
    unknown = sorted(set(data) - set(_TOP_LEVEL))
    if unknown:
        raise ConfigError(
            "config", unknown, "use top-level preset and the tables [scheduler] and [cache]"
        )
    name = data.get("preset")
    if name is not None and name not in PRESETS:
        raise ConfigError("preset", name, f"use one of {PRESETS}")
    scheduler = _table(data, "scheduler")
    overrides = tuple((key, _checked(key, value)) for key, value in scheduler.items())
    cache = _table(data, "cache")
    unknown_cache = sorted(set(cache) - {"retention"})
    if unknown_cache:
        key = unknown_cache[0]
        raise ConfigError(f"cache.{key}", cache[key], "the cache table takes only retention")
    retention = cache.get("retention")
    if old_retention is not None:
        if retention is not None:
            raise ConfigError(
                "retention",
                old_retention,
                f"the file also sets [cache] retention = {retention!r}; keep only that one",
            )
        deprecations.append(_DEPRECATED_RETENTION.format(value=old_retention))
        retention = old_retention
    _check_retention("cache.retention", retention)
    # Validate the combination now, not in the middle of a run: over the file's preset (or
    # the default one; the command's own preset is checked again when the engine is built).
    base = preset(name or DEFAULT_PRESET, quantum=1, max_model_len=SchedulerConfig().max_model_len)
    replace(base.scheduler, **dict(overrides))
    return SettingsFile(name, overrides, retention, tuple(deprecations))


def _table(data: Mapping[str, Any], name: str) -> dict[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(name, table, f"write it as a table: [{name}] with key = value lines")
    return table


def _check_retention(key: str, retention: object) -> None:
    if retention is None:
        return
    if not isinstance(retention, str):
        raise ConfigError(key, retention, "write it as a string, e.g. 'boundary+predecessor'")
    Retention.parse(retention)  # validates, with its own clear error


def _checked(key: str, value: Any) -> Any:
    """The value of `[scheduler] key`, type-checked against the SchedulerConfig field (enum
    fields such as `policy` are coerced by SchedulerConfig itself, the one place)."""
    field = _SCHEDULER_FIELDS.get(key)
    if field is None:
        raise ConfigError(f"scheduler.{key}", value, f"use one of {sorted(_SCHEDULER_FIELDS)}")
    expected = field.default
    if isinstance(expected, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"scheduler.{key}", value, "write true or false")
    elif isinstance(expected, int) and not isinstance(expected, str):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"scheduler.{key}", value, "write a whole number")
    elif isinstance(expected, float):
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(f"scheduler.{key}", value, "write a number")
        if not math.isfinite(value):  # TOML writes nan and inf; every comparison passes nan
            raise ConfigError(f"scheduler.{key}", value, "write a finite number, e.g. 0 (off)")
        return float(value)
    elif isinstance(expected, str) and not isinstance(value, str):
        raise ConfigError(f"scheduler.{key}", value, f"write it as a string, e.g. '{expected}'")
    return value


# ----- resolution: preset -> file -> flags -------------------------------------------------------


def preset_name(flag: str | None, file: SettingsFile | None) -> str:
    """The preset a run builds on: the `--preset` flag when given, else the file's, else
    `hybridserve`."""
    if flag is not None:
        return flag
    if file is not None and file.preset is not None:
        return file.preset
    return DEFAULT_PRESET


def resolve_settings(
    name: str,
    *,
    quantum: int,
    max_model_len: int,
    scheduler: tuple[tuple[str, Any], ...] = (),
    retention: str | None = None,
    flags: Mapping[str, Any] | None = None,
    retention_flag: str | None = None,
) -> Preset:
    """The preset `name`, then the file's `scheduler` fields and `retention`, then the flags
    (SchedulerConfig fields; a None value is a flag not given) and `retention_flag`."""
    chosen = preset(name, quantum=quantum, max_model_len=max_model_len)
    merged = dict(scheduler)
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    for key in given:
        if key not in _SCHEDULER_FIELDS:
            raise ConfigError(key, given[key], f"use one of {sorted(_SCHEDULER_FIELDS)}")
    merged.update(given)
    config = replace(chosen.scheduler, **merged) if merged else chosen.scheduler
    text = retention_flag if retention_flag is not None else retention
    kept = Retention.parse(text) if text is not None else chosen.retention
    return replace(chosen, scheduler=config, retention=kept)


@dataclass(frozen=True, slots=True)
class SettingsSources:
    """Where one run's settings come from, before the model is known: the `--preset` flag, the
    `--config` file and the SchedulerConfig fields given as flags (`serve` and `generate` both
    take these). `resolve` applies them, in that order, once the model's state quantum and
    context limit are known."""

    preset: str | None = None  # None: the file's preset, else DEFAULT_PRESET
    file: SettingsFile | None = None
    flags: tuple[tuple[str, Any], ...] = ()  # SchedulerConfig fields; a None value: not given
    retention: str | None = None  # the `--retention` flag

    def resolve(self, *, quantum: int, max_model_len: int) -> Preset:
        """The settings; the scheduler's `max_model_len` is `max_model_len` unless a flag or
        the file sets it."""
        return resolve_settings(
            preset_name(self.preset, self.file),
            quantum=quantum,
            max_model_len=max_model_len,
            scheduler=self.file.scheduler if self.file is not None else (),
            retention=self.file.retention if self.file is not None else None,
            flags=dict(self.flags),
            retention_flag=self.retention,
        )
