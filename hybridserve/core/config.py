"""Frozen, validated configuration objects for speculation, caching and scheduling."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import StrEnum

from hybridserve.core.errors import ConfigError, RequestError


class SpeculativeMethod(StrEnum):
    """Speculative decoding methods. Only their capabilities matter to the cache."""

    NONE = "none"
    EAGLE = "eagle"
    EAGLE3 = "eagle3"
    MTP = "mtp"
    DFLASH = "dflash"
    DSPARK = "dspark"
    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"


# EAGLE-style heads (EAGLE, EAGLE3, MTP) read the target's hidden state at position p together
# with the token at p + 1, so the drafter's KV at p depends on a token past p. vLLM 0.33 handles
# it with lookahead block hashes (a block's hash also covers the next L tokens, so a hit implies
# that the drafter's inputs matched) and drops nothing; older vLLM (and `lookahead_block_hashes=
# False` here) dropped the last matched block instead (SPEC.md 3.2). DFlash/DSpark/n-gram/draft
# models leave target KV exact and need neither (SPEC.md 3.6).
_HIDDEN_STATE_DRAFTERS = frozenset(
    {SpeculativeMethod.EAGLE, SpeculativeMethod.EAGLE3, SpeculativeMethod.MTP}
)


@dataclass(frozen=True, kw_only=True, slots=True)
class SpeculativeConfig:
    """A speculative decoding method described by its capabilities.

    * `lookahead_block_hashes` (vLLM 0.33's default, its `disable_lookahead_block_hashes=False`):
      for EAGLE-style methods each block hash also covers the next `hash_lookahead_tokens`
      tokens and no block is dropped at lookup. False selects the legacy one-block drop.
    * `multi_module_mtp`: an MTP drafter with one module per draft token; its prefill looks
      `num_speculative_tokens` tokens ahead (the hash lookahead), one otherwise.
    """

    method: SpeculativeMethod = SpeculativeMethod.NONE
    num_speculative_tokens: int = 0
    lookahead_block_hashes: bool = True
    multi_module_mtp: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.method, SpeculativeMethod):
            raise ConfigError(
                "speculative.method",
                self.method,
                f"use one of {[m.value for m in SpeculativeMethod]}",
            )
        if (
            isinstance(self.num_speculative_tokens, bool)
            or not isinstance(self.num_speculative_tokens, int)
            or self.num_speculative_tokens < 0
        ):
            raise ConfigError(
                "speculative.num_speculative_tokens",
                self.num_speculative_tokens,
                "use 0 or a positive number of draft tokens",
            )
        if self.method is SpeculativeMethod.NONE and self.num_speculative_tokens != 0:
            raise ConfigError(
                "speculative.num_speculative_tokens",
                self.num_speculative_tokens,
                "set a speculative method, or set num_speculative_tokens=0",
            )
        for name in ("lookahead_block_hashes", "multi_module_mtp"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"speculative.{name}", getattr(self, name), "use true or false")
        if self.multi_module_mtp and self.method is not SpeculativeMethod.MTP:
            raise ConfigError(
                "speculative.multi_module_mtp", True, "only the mtp method has MTP modules"
            )

    @property
    def uses_hidden_states(self) -> bool:
        """EAGLE/EAGLE3/MTP: the drafter reads target hidden states (vLLM's `use_eagle`)."""
        return self.method in _HIDDEN_STATE_DRAFTERS

    @property
    def drops_target_tail(self) -> bool:
        """True when a prefix hit must recompute the last block of the EAGLE groups: the
        legacy path (vLLM's `use_eagle_block_drop`), never with lookahead block hashes."""
        return self.uses_hidden_states and not self.lookahead_block_hashes

    @property
    def hash_lookahead_tokens(self) -> int:
        """L: tokens past a block that its hash also covers (vLLM's
        `num_hash_lookahead_tokens`): the drafter's prefill lookahead, 0 without one."""
        if not self.uses_hidden_states or not self.lookahead_block_hashes:
            return 0
        return max(self.num_speculative_tokens, 1) if self.multi_module_mtp else 1

    @property
    def name(self) -> str:
        """The method's name, with `-legacy` for the one-block-drop form."""
        if self.uses_hidden_states and not self.lookahead_block_hashes:
            return f"{self.method.value}-legacy"
        return str(self.method.value)

    @classmethod
    def from_name(
        cls,
        name: str,
        num_speculative_tokens: int | None = None,
        *,
        lookahead_block_hashes: bool = True,
    ) -> SpeculativeConfig:
        """Build from a method name; a speculative method defaults to 1 draft token.

        `eagle-legacy` / `eagle3-legacy` / `mtp-legacy` name the legacy one-block drop.
        """
        text = name.lower()
        if text.endswith("-legacy"):
            text, lookahead_block_hashes = text[: -len("-legacy")], False
        try:
            method = SpeculativeMethod(text)
        except ValueError:
            raise ConfigError(
                "speculative.method", name, f"use one of {list(SPECULATION_NAMES)}"
            ) from None
        if method not in _HIDDEN_STATE_DRAFTERS:
            if not lookahead_block_hashes and name.lower().endswith("-legacy"):
                raise ConfigError(
                    "speculative.method", name, "only eagle, eagle3 and mtp have a legacy form"
                )
            lookahead_block_hashes = True
        if num_speculative_tokens is None:
            num_speculative_tokens = 0 if method is SpeculativeMethod.NONE else 1
        return cls(
            method=method,
            num_speculative_tokens=num_speculative_tokens,
            lookahead_block_hashes=lookahead_block_hashes,
        )


SPECULATION_NAMES = (
    *(m.value for m in SpeculativeMethod),
    *(f"{m.value}-legacy" for m in SpeculativeMethod if m in _HIDDEN_STATE_DRAFTERS),
)


class SchedulingPolicy(StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class ProgramPriority(StrEnum):
    """How the waiting queue orders turns of sessions (programs). OFF is vLLM's order."""

    OFF = "off"
    PLAS = "plas"  # least attained service of the session first (Autellix's PLAS)
    FCFS = "fcfs"  # earliest session arrival first (program-level FCFS)


# vLLM's engine defaults, the one place they are written: everything that defaults one of these
# knobs (the simulator's memory rule and cost model) reads them from here.
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """Token-budget scheduler limits (vLLM v1 semantics) and the prefill/decode controls.

    Every control defaults to 0, which means off; with all of them off the schedule is vLLM's.
    """

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
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
    # The adaptive prefill budget (scheduler/adaptive.py), 0 = off: the duration that steps
    # carrying decodes aim for, and the oldest waiter's wait past which the budget grows
    # whatever the step time (0: never). Its ceiling is max_num_batched_tokens. While that
    # valve is open, steps may run up to adaptive_budget_pressure_itl_ms (0: no step-time
    # limit, the budget grows to its ceiling). With adaptive_budget_calm_itl_ms (0 = off) steps
    # aim for that shorter time while nothing in prefill has waited, and for
    # adaptive_budget_itl_ms once the oldest prefill has waited adaptive_budget_queue_ms, in a
    # straight line between.
    adaptive_budget_itl_ms: float = 0.0
    adaptive_budget_queue_ms: float = 0.0
    adaptive_budget_pressure_itl_ms: float = 0.0
    adaptive_budget_calm_itl_ms: float = 0.0
    # With adaptive_budget_context_weight, a prefill chunk of n tokens from position s takes
    # n + (n s + n (n + 1) / 2) / S0 of the adaptive budget (its tokens and its attention
    # pairs), S0 fitted from the steps' times (the context at which a token's attention costs
    # what the rest of it does): a chunk after a long context is smaller.
    # Needs the adaptive budget; beside a mixed-prefill cap or target_mixed_step_ms (which
    # share the budget out their own way) it turns itself off, with a notice.
    adaptive_budget_context_weight: bool = False
    # The first-token deadline of the waiting queue (scheduler/queue.py DeadlineQueue), 0 = off:
    # a request that has waited this long goes behind every request that has not (FCFS only).
    waiting_deadline_ms: float = 0.0
    # Agent-aware controls, all off by default (docs/vllm_baseline.md "differs on purpose").
    # Tool-call TTL pinning: the fraction of the pool a finished turn's prefix may hold out
    # of eviction until its session returns (0 = off), the TTL cap and the gap quantile.
    kv_pin_fraction: float = 0.0
    kv_pin_max_ttl_s: float = 30.0
    kv_pin_ttl_quantile: float = 0.9
    # Exact tails: a pin also holds the turn's partial last block and running state, so the
    # session's next turn resumes at the turn's exact end (needs kv_pin_fraction > 0).
    kv_pin_exact_tail: bool = False
    # Program-level priority of waiting turns, and the age after which a turn goes first.
    program_priority: ProgramPriority = ProgramPriority.OFF
    program_priority_max_wait_s: float = 10.0
    # Admit a waiting request only if the running ones can still grow by their remaining
    # output (up to the horizon) without a preemption.
    kv_aware_admission: bool = False
    kv_admission_horizon_tokens: int = 1024

    def __post_init__(self) -> None:
        self._coerce_enums()
        for flag in _BOOL_FIELDS:
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"scheduler.{flag}", getattr(self, flag), "use true or false")
        _require_finite(self)
        self._check_ranges()
        self._check_agent_controls()
        self._check_dependencies()

    def _coerce_enums(self) -> None:
        """A policy or program priority given by name is coerced once here; anything else is
        an error, never a silent fall-back to the default."""
        if not isinstance(self.policy, SchedulingPolicy):
            try:
                object.__setattr__(self, "policy", SchedulingPolicy(str(self.policy).lower()))
            except ValueError:
                raise ConfigError(
                    "scheduler.policy",
                    self.policy,
                    f"use one of {[p.value for p in SchedulingPolicy]}",
                ) from None
        if not isinstance(self.program_priority, ProgramPriority):
            try:
                object.__setattr__(
                    self, "program_priority", ProgramPriority(str(self.program_priority).lower())
                )
            except ValueError:
                raise ConfigError(
                    "scheduler.program_priority",
                    self.program_priority,
                    f"use one of {[p.value for p in ProgramPriority]}",
                ) from None

    def _check_ranges(self) -> None:
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
        for name in (
            "decode_prefill_max_wait_ms",
            "target_mixed_step_ms",
            "adaptive_budget_itl_ms",
            "adaptive_budget_queue_ms",
            "adaptive_budget_pressure_itl_ms",
            "adaptive_budget_calm_itl_ms",
            "waiting_deadline_ms",
        ):
            _require_non_negative(f"scheduler.{name}", getattr(self, name))

    def _check_dependencies(self) -> None:
        """Controls that only mean something alongside another one."""
        if self.adaptive_budget_context_weight and not self.adaptive_budget_itl_ms:
            raise ConfigError(
                "scheduler.adaptive_budget_context_weight",
                True,
                "the context weight belongs to the adaptive budget: set adaptive_budget_itl_ms > 0",
            )
        if self.adaptive_budget_queue_ms > 0 and not self.adaptive_budget_itl_ms:
            raise ConfigError(
                "scheduler.adaptive_budget_queue_ms",
                self.adaptive_budget_queue_ms,
                "the queue valve belongs to the adaptive budget: set adaptive_budget_itl_ms > 0",
            )
        pressure_ms = self.adaptive_budget_pressure_itl_ms
        if pressure_ms > 0 and (
            not self.adaptive_budget_queue_ms or pressure_ms < self.adaptive_budget_itl_ms
        ):
            raise ConfigError(
                "scheduler.adaptive_budget_pressure_itl_ms",
                pressure_ms,
                "it is the queue valve's step-time limit: set adaptive_budget_queue_ms > 0 and "
                f"use at least adaptive_budget_itl_ms={self.adaptive_budget_itl_ms}",
            )
        calm_ms = self.adaptive_budget_calm_itl_ms
        if calm_ms > 0 and (
            not self.adaptive_budget_queue_ms or calm_ms > self.adaptive_budget_itl_ms
        ):
            raise ConfigError(
                "scheduler.adaptive_budget_calm_itl_ms",
                calm_ms,
                "it is the step time aimed at before the queue waits: set "
                "adaptive_budget_queue_ms > 0 and use at most "
                f"adaptive_budget_itl_ms={self.adaptive_budget_itl_ms}",
            )
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

    def _check_agent_controls(self) -> None:
        frac = self.kv_pin_fraction
        if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0.0 <= frac <= 1.0:
            raise ConfigError(
                "scheduler.kv_pin_fraction", frac, "use 0 (off) or a fraction of the pool in (0, 1]"
            )
        _require_strictly_positive("scheduler.kv_pin_max_ttl_s", self.kv_pin_max_ttl_s)
        if self.kv_pin_exact_tail and not frac:
            raise ConfigError(
                "scheduler.kv_pin_exact_tail",
                True,
                "exact tails are held by tool-call pins; set kv_pin_fraction > 0 or turn it off",
            )
        q = self.kv_pin_ttl_quantile
        if isinstance(q, bool) or not isinstance(q, int | float) or not 0.0 < q <= 1.0:
            raise ConfigError("scheduler.kv_pin_ttl_quantile", q, "use a quantile in (0, 1]")
        _require_strictly_positive(
            "scheduler.program_priority_max_wait_s", self.program_priority_max_wait_s
        )
        _require_positive("scheduler.kv_admission_horizon_tokens", self.kv_admission_horizon_tokens)
        if self.program_priority is not ProgramPriority.OFF and (
            self.policy is SchedulingPolicy.PRIORITY
        ):
            raise ConfigError(
                "scheduler.program_priority",
                self.program_priority.value,
                "program priority orders an fcfs queue; set policy=fcfs or program_priority=off",
            )
        if self.waiting_deadline_ms > 0 and (
            self.policy is SchedulingPolicy.PRIORITY
            or self.program_priority is not ProgramPriority.OFF
        ):
            raise ConfigError(
                "scheduler.waiting_deadline_ms",
                self.waiting_deadline_ms,
                "the deadline orders the plain fcfs queue; set policy=fcfs and "
                "program_priority=off, or waiting_deadline_ms=0",
            )

    @property
    def pins_kv(self) -> bool:
        return self.kv_pin_fraction > 0

    def check_priority(self, priority: int) -> None:
        """The one priority rule: the fcfs policy takes priority 0 only. Raises RequestError."""
        if self.policy is SchedulingPolicy.FCFS and priority != 0:
            raise RequestError("priority", priority, "the fcfs scheduler takes priority 0 only")


_BOOL_FIELDS = (
    "enable_chunked_prefill",
    "reserve_full_isl",
    "kv_aware_admission",
    "kv_pin_exact_tail",
)
# Every float field (annotations are strings here): NaN and inf are refused for each.
_FLOAT_FIELDS = tuple(f.name for f in fields(SchedulerConfig) if f.type == "float")


def _require_finite(config: SchedulerConfig) -> None:
    # NaN passes every comparison (nan < 0 is False): refuse it, and inf, before the checks.
    for name in _FLOAT_FIELDS:
        value = getattr(config, name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"scheduler.{name}", value, "use a finite number")


def _require_strictly_positive(field: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(field, value, "use a positive number")


def _require_positive(field: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(field, value, "use a positive integer")


def _require_non_negative(field: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ConfigError(field, value, "use 0 (off) or a positive number")
