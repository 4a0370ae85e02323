"""Prefill/decode controls (SPEC.md 5.2) and the adaptive time budget (5.3). All off by default.

The controller decides, before the running loop, the prefill shape of the step: whether local
prefill runs at all (decode bursts, the oldest-waiter deadline), how many prefill tokens a mixed
step may carry (token cap Cp, or a time target T through the step-time model), how those quanta
rotate over running partial prefills, and what the head waiter may take. With every control at 0
it returns the unlimited plan and the schedule is vLLM's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridserve.core.config import SchedulerConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.request import Request
from hybridserve.scheduler.step_model import StepTimeModel

FALLBACK_ERROR = 0.25  # prediction error above which the adaptive grant falls back


def is_decode(request: Request) -> bool:
    """The request has finished its prompt (and any recompute): its next token is a decode."""
    return request.num_computed_tokens >= max(request.num_prompt_tokens, request.num_tokens - 1)


@dataclass(slots=True)
class PrefillPlan:
    """The prefill shape of one step."""

    allow_prefill: bool = True  # False: a decode-only burst step
    grants: dict[str, int] | None = None  # running partial prefill -> max tokens; None = any
    waiter_tokens: int | None = None  # tokens admissions may take; None = the token budget
    bypass: bool = False  # the oldest-waiter deadline opened this step
    eligible_decode: bool = False
    pending: bool = False
    mixed_budget: int = 0  # Bp, the governed prefill tokens of a mixed step


UNLIMITED = PrefillPlan()


@dataclass(slots=True)
class ControlStats:
    """SPEC.md 6.3 counters."""

    governed_prefill_tokens: int = 0
    decode_only_steps_while_pending: int = 0
    deadline_bypasses: int = 0
    adaptive_fallbacks: int = 0
    active_partial_prefills: int = 0  # gauge, after the last step
    last_grants: dict[str, int] = field(default_factory=dict)

    def samples(self) -> list[tuple[str, str, float]]:
        """(name, type, value) in Prometheus naming under `hybridserve:`."""
        return [
            (
                "hybridserve:scheduler_governed_prefill_tokens_total",
                "counter",
                self.governed_prefill_tokens,
            ),
            (
                "hybridserve:scheduler_active_partial_prefills",
                "gauge",
                self.active_partial_prefills,
            ),
            (
                "hybridserve:scheduler_decode_only_steps_while_prefill_pending_total",
                "counter",
                self.decode_only_steps_while_pending,
            ),
            ("hybridserve:scheduler_deadline_bypasses_total", "counter", self.deadline_bypasses),
            (
                "hybridserve:scheduler_adaptive_budget_fallbacks_total",
                "counter",
                self.adaptive_fallbacks,
            ),
        ]


class PrefillController:
    def __init__(
        self, config: SchedulerConfig, *, quantum: int, step_model: StepTimeModel | None = None
    ) -> None:
        if config.max_num_prefill_tokens_per_step % quantum:
            raise ConfigError(
                "scheduler.max_num_prefill_tokens_per_step",
                config.max_num_prefill_tokens_per_step,
                f"use a multiple of the quantum q={quantum} (the state block size)",
            )
        self.config = config
        self.quantum = quantum
        self.cap = config.max_num_prefill_tokens_per_step
        self.max_partials = config.max_num_partial_prefills
        self.min_decode_steps = config.decode_prefill_min_decode_steps
        self.max_wait_s = config.decode_prefill_max_wait_ms / 1000.0
        self.target_s = config.target_mixed_step_ms / 1000.0
        self.model = step_model if step_model is not None else StepTimeModel()
        self.enabled = bool(self.cap or self.max_partials or self.min_decode_steps or self.target_s)
        self.since = 0  # decode-only steps since the last prefill release, saturating at D
        self.rot = 0
        self.stats = ControlStats()

    # ----- plan -------------------------------------------------------------------------------

    def plan(
        self,
        *,
        now: float,
        running: Sequence[Request],
        waiting: Sequence[Request],
        token_budget: int,
        seq_slot_free: bool,
    ) -> PrefillPlan:
        if not self.enabled:
            return UNLIMITED
        decodes = [r for r in running if is_decode(r)]
        partials = [r for r in running if not is_decode(r)]
        pending = bool(partials) or bool(waiting)
        if not decodes:
            return PrefillPlan(pending=pending)  # nothing to protect: the full budget
        plan = PrefillPlan(eligible_decode=True, pending=pending)
        if self.min_decode_steps and pending and self.since < self.min_decode_steps:
            if self.max_wait_s > 0 and _oldest_age(waiting, now) >= self.max_wait_s:
                plan.bypass = True
            else:
                plan.allow_prefill = False
                return plan
        decode_tokens = sum(r.num_tokens_with_spec - r.num_computed_tokens for r in decodes)
        budget = self._mixed_budget(token_budget - decode_tokens, decodes, partials)
        if budget is None:
            return plan  # only Mp / D / W are on: no token cap
        plan.mixed_budget = budget
        quanta = budget // self.quantum
        partial_free = not self.max_partials or len(partials) < self.max_partials
        reserve = 1 if (waiting and seq_slot_free and partial_free and quanta > 0) else 0
        plan.grants = self._rotate(partials, quanta - reserve)
        unused = sum(
            max(g - (r.num_tokens - r.num_computed_tokens), 0)
            for r, g in ((r, plan.grants[r.req_id]) for r in partials)
        )
        plan.waiter_tokens = reserve * self.quantum + unused // self.quantum * self.quantum
        self.stats.last_grants = dict(plan.grants)
        return plan

    def _mixed_budget(
        self, room: int, decodes: Sequence[Request], partials: Sequence[Request]
    ) -> int | None:
        """Bp: the token cap and/or the adaptive time grant, floored to the quantum."""
        if not self.cap and not self.target_s:
            return None
        limit = max(room, 0)
        if self.cap:
            limit = min(limit, self.cap)
        if self.target_s:
            # At least one quantum: prefill never starves (a deadline bypass always moves),
            # and a mixed step exceeds T by at most one quantum's cost.
            limit = min(limit, max(self._adaptive_grant(decodes, partials), self.quantum))
        return limit // self.quantum * self.quantum

    def _adaptive_grant(self, decodes: Sequence[Request], partials: Sequence[Request]) -> int:
        """The largest prefill (a multiple of q) predicted to keep the mixed step within T."""
        model = self.model
        if model.recent_error > FALLBACK_ERROR:
            self.stats.adaptive_fallbacks += 1
            return self.cap if self.cap else self.quantum
        n_decode = sum(r.num_tokens_with_spec - r.num_computed_tokens for r in decodes)
        kv_decode = sum(r.num_computed_tokens for r in decodes)
        base = model.predict(model.features(n_decode, 0, kv_decode))
        context = sum(r.num_computed_tokens for r in partials) / len(partials) if partials else 0
        c = model.theta
        per_token = c[2] + c[3] * context
        slack = self.target_s - base
        if slack <= 0:
            return 0
        tokens = slack / per_token if per_token > 0 else math.inf
        if not math.isfinite(tokens):
            return 1 << 30  # no per-token cost learned: only the step cap binds
        return int(tokens) // self.quantum * self.quantum

    def _rotate(self, partials: Sequence[Request], quanta: int) -> dict[str, int]:
        """Equal shares of the quanta; the remainder goes to consecutive requests from `rot`."""
        if not partials or quanta <= 0:
            return {r.req_id: 0 for r in partials}
        share, extra = divmod(quanta, len(partials))
        start = self.rot % len(partials)
        grants = {}
        for offset in range(len(partials)):
            request = partials[(start + offset) % len(partials)]
            grants[request.req_id] = (share + (1 if offset < extra else 0)) * self.quantum
        self.rot = (start + (extra if extra else 1)) % len(partials)
        return grants

    # ----- admissions ---------------------------------------------------------------------------

    def admits(self, *, partials_after: int, completes: bool) -> bool:
        """Mp: a waiter may join only if the partial prefills left after the step stay <= Mp;
        a waiter that completes its prefill within its grant is always admissible."""
        return completes or not self.max_partials or partials_after + 1 <= self.max_partials

    # ----- observe ------------------------------------------------------------------------------

    def observe(self, plan: PrefillPlan, *, prefill_tokens: int, partials_after: int) -> None:
        if not self.enabled:
            return
        stats = self.stats
        stats.active_partial_prefills = partials_after
        if not plan.eligible_decode:
            self.since = 0
        elif prefill_tokens:
            self.since = 0
            stats.governed_prefill_tokens += prefill_tokens
            if plan.bypass:
                stats.deadline_bypasses += 1
        else:
            self.since = min(self.since + 1, self.min_decode_steps)
            if plan.pending:
                stats.decode_only_steps_while_pending += 1

    def learn(self, *, decode: int, prefill: int, kv_tokens_read: int, duration_s: float) -> None:
        """Feed a finished step's measured (or simulated) duration to the step-time model."""
        if self.target_s and duration_s > 0:
            self.model.update(self.model.features(decode, prefill, kv_tokens_read), duration_s)


def _oldest_age(waiting: Sequence[Request], now: float) -> float:
    return max((now - r.arrival_time for r in waiting), default=0.0)
