"""Frozen, validated configuration objects for speculation, caching and scheduling."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from hybridserve.core.errors import ConfigError


class SpecMethod(StrEnum):
    """Speculative decoding methods. Only their capabilities matter to the cache."""

    NONE = "none"
    EAGLE = "eagle"
    EAGLE3 = "eagle3"
    MTP = "mtp"
    DFLASH = "dflash"
    DSPARK = "dspark"
    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"


# EAGLE-style heads read the target's hidden states at the last prefix positions, which the KV
# cache does not hold, so a prefix hit must recompute the last alignment unit (SPEC.md 3.2).
# DFlash/DSpark/n-gram/draft models leave target KV exact and must not lose it (SPEC.md 3.6).
_DROPS_TARGET_TAIL = frozenset({SpecMethod.EAGLE, SpecMethod.EAGLE3, SpecMethod.MTP})


@dataclass(frozen=True, kw_only=True, slots=True)
class SpeculativeConfig:
    """A speculative decoding method described by its capabilities."""

    method: SpecMethod = SpecMethod.NONE
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.method, SpecMethod):
            raise ConfigError(
                "speculative.method",
                self.method,
                f"use one of {[m.value for m in SpecMethod]}",
            )
        if self.num_speculative_tokens < 0:
            raise ConfigError(
                "speculative.num_speculative_tokens",
                self.num_speculative_tokens,
                "use 0 or a positive number of draft tokens",
            )
        if self.method is SpecMethod.NONE and self.num_speculative_tokens != 0:
            raise ConfigError(
                "speculative.num_speculative_tokens",
                self.num_speculative_tokens,
                "set a speculative method, or set num_speculative_tokens=0",
            )

    @property
    def drops_target_tail(self) -> bool:
        """True when a prefix hit must recompute the last alignment unit of target groups."""
        return self.method in _DROPS_TARGET_TAIL

    @classmethod
    def from_name(cls, name: str, num_speculative_tokens: int | None = None) -> SpeculativeConfig:
        """Build from a method name; a speculative method defaults to 1 draft token."""
        try:
            method = SpecMethod(name.lower())
        except ValueError:
            raise ConfigError(
                "speculative.method", name, f"use one of {[m.value for m in SpecMethod]}"
            ) from None
        if num_speculative_tokens is None:
            num_speculative_tokens = 0 if method is SpecMethod.NONE else 1
        return cls(method=method, num_speculative_tokens=num_speculative_tokens)


class SchedulingPolicy(StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """Token-budget scheduler limits (vLLM v1 semantics) and the prefill/decode controls.

    Every control defaults to 0, which means off; with all of them off the schedule is vLLM's.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131072
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    reserve_full_isl: bool = True
    # SPEC.md 5.2: the controls, all 0 = off.
    max_num_prefill_tokens_per_step: int = 0
    max_num_partial_prefills: int = 0
    decode_prefill_min_decode_steps: int = 0
    decode_prefill_max_wait_ms: float = 0.0
    # SPEC.md 5.3: adaptive time budget, 0 = off.
    target_mixed_step_ms: float = 0.0

    def __post_init__(self) -> None:
        _require_positive("scheduler.max_num_seqs", self.max_num_seqs)
        _require_positive("scheduler.max_num_batched_tokens", self.max_num_batched_tokens)
        _require_positive("scheduler.max_model_len", self.max_model_len)
        for name in (
            "long_prefill_token_threshold",
            "max_num_prefill_tokens_per_step",
            "max_num_partial_prefills",
            "decode_prefill_min_decode_steps",
        ):
            _require_non_negative(f"scheduler.{name}", getattr(self, name))
        for name in ("decode_prefill_max_wait_ms", "target_mixed_step_ms"):
            _require_non_negative(f"scheduler.{name}", getattr(self, name))
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "scheduler.max_num_batched_tokens",
                self.max_num_batched_tokens,
                f"without chunked prefill it must be >= max_model_len={self.max_model_len}; "
                "raise it or enable chunked prefill",
            )
        if self.decode_prefill_min_decode_steps > 0 and self.max_num_prefill_tokens_per_step == 0:
            raise ConfigError(
                "scheduler.decode_prefill_min_decode_steps",
                self.decode_prefill_min_decode_steps,
                "decode bursts need max_num_prefill_tokens_per_step > 0",
            )
        if self.decode_prefill_max_wait_ms > 0 and self.decode_prefill_min_decode_steps == 0:
            raise ConfigError(
                "scheduler.decode_prefill_max_wait_ms",
                self.decode_prefill_max_wait_ms,
                "a deadline needs decode_prefill_min_decode_steps > 0",
            )


def _require_positive(field: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(field, value, "use a positive integer")


def _require_non_negative(field: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ConfigError(field, value, "use 0 (off) or a positive number")
