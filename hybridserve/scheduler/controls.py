"""Prefill/decode controls (SPEC.md 5.2) and the adaptive time budget (5.3). All off by default.

The controls are three pieces, each with one job; the scheduler asks them at fixed points of its
loop, so a new control is a change here, never a branch in the loop:

* `PrefillController` decides, before the running loop, the prefill shape of a step: whether
  local prefill runs at all (decode bursts D, the oldest-waiter deadline W), how many prefill
  tokens a mixed step may carry (token cap Cp, or a time target T through the step-time model),
  how those quanta rotate over running partial prefills, what the head waiter may take, and the
  bound Mp on partial prefills. It owns the state that carries over between steps.
* `PrefillDecision` is that decision, frozen. With every control at 0 it is `UNLIMITED` and the
  schedule is vLLM's.
* `PrefillAllowance` is one step's use of its decision by the admissions and by the reclaim of the
  quanta the head waiter could not use.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING

from hybridserve.core.config import SchedulerConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.request import Request
from hybridserve.scheduler.adaptive import (
    AdaptiveBudget,
    ContextWeight,
    prefill_work,
    tokens_within,
)
from hybridserve.scheduler.step_model import StepTimeModel

if TYPE_CHECKING:
    from hybridserve.scheduler.output import SchedulerOutput
    from hybridserve.scheduler.step import StepState

FALLBACK_ERROR = 0.25  # prediction error above which the adaptive grant falls back


def is_decode(request: Request) -> bool:
    """The request has finished its prompt (and any recompute): its next token is a decode."""
    return request.num_computed_tokens >= request.prefill_end


def count_partials(running: Sequence[Request]) -> int:
    """Running requests still short of their prefill end: the active partial prefills."""
    return sum(1 for r in running if not is_decode(r))


@dataclass(frozen=True, slots=True)
class PrefillDecision:
    """The prefill shape of one step, decided before the running loop and never changed after.

    The limits: `allow_prefill` (False: a decode-only burst step), `grants` (running partial
    prefill -> the most tokens it may take; None: no cap), `waiter_tokens` (what admissions may
    take together; None: the token budget) and `max_partials` (Mp, the partial prefills an
    admission may leave behind; 0: no bound). The rest records why, for `observe` and the
    step's output, and what committing the decision advances the controller by: `rotation` (the
    rotation pointer for the next decision; None: unchanged) and `adaptive_fallback`.
    """

    allow_prefill: bool = True
    grants: Mapping[str, int] | None = None
    waiter_tokens: int | None = None
    max_partials: int = 0
    bypass: bool = False  # the oldest-waiter deadline opened this step
    eligible_decode: bool = False  # a running request decodes this step
    pending: bool = False  # prefill is waiting: a partial prefill runs or a request waits
    mixed_budget: int = 0  # Bp, the governed prefill tokens of a mixed step
    rotation: int | None = None
    adaptive_fallback: bool = False  # the time grant fell back: its prediction error is high
    queue_pressure: bool = False  # the adaptive budget's queue valve was open for this decision
    oldest_wait_s: float = 0.0  # how long the oldest request in prefill had waited (adaptive)
    # The adaptive budget governs this mixed step, and `learn` moves it by the step's time
    # (grants stay None when it reaches the step's whole room: vLLM's own loop, unfloored).
    adaptive_step: bool = False
    # The adaptive budget's context weight for this step (scheduler/adaptive.py ContextWeight):
    # S0 (0: every prefill token takes 1 of the budget), and the tokens the step's first
    # prefill may always take however long its context (the budget's floor).
    context_tokens: float = 0.0
    min_prefill_tokens: int = 0

    @property
    def unlimited(self) -> bool:
        """No control binds this step: every request takes what vLLM's loop gives it."""
        return (
            self.allow_prefill
            and self.grants is None
            and self.waiter_tokens is None
            and not self.max_partials
        )

    def grant(self, req_id: str, num_new: int) -> int:
        """The tokens of `num_new` a running partial prefill may take this step."""
        if not self.allow_prefill:
            return 0
        grants = self.grants
        if grants is None:
            return num_new
        return min(num_new, grants.get(req_id, 0))


# Every control off; a decision is tested with `decision.unlimited`, never `is`.
UNLIMITED = PrefillDecision()
# A mixed step the adaptive budget governs but leaves to vLLM's loop (it covers the room).
UNLIMITED_MIXED = PrefillDecision(eligible_decode=True, adaptive_step=True)


# What the reclaim asks of the scheduler: (request, tokens already in the step, the total it may
# now have) -> the extra tokens it took after alignment (0: none), or None when they do not fit.
TakeMore = Callable[[Request, int, int], int | None]


class PrefillAllowance:
    """One step's use of its decision: the tokens the head waiter may still take and the partial
    prefills this step's admissions started. Created per schedule() call; the decision is frozen."""

    __slots__ = ("decision", "new_partials", "start", "waiter_tokens")

    def __init__(self, decision: PrefillDecision) -> None:
        self.decision = decision
        self.waiter_tokens = decision.waiter_tokens
        self.new_partials = 0
        self.start = 0  # where the prefill of the admission being sized starts

    def admission_tokens(self, num_new: int, start: int = 0) -> int:
        """What the next admission, whose prefill starts at `start`, may take of `num_new` (0
        or less: admissions stop). Under the context weight its chunk takes its
        `prefill_work` of what is left; the step's first prefill may always take the budget's
        floor."""
        left = self.waiter_tokens
        if left is None:
            return num_new
        decision = self.decision
        self.start = start
        if decision.context_tokens <= 0 or left <= 0:
            return min(num_new, left)
        fit = tokens_within(left, start, decision.context_tokens)
        if left == decision.mixed_budget:  # nothing of the budget spent yet this step
            fit = max(fit, min(decision.min_prefill_tokens, left))
        return min(num_new, fit)

    def admits(self, *, completes: bool, running: Sequence[Request], step: StepState) -> bool:
        """Mp: a waiter may join only if the partial prefills left after the step stay <= Mp;
        a waiter that completes its prefill within its grant is always admissible."""
        bound = self.decision.max_partials
        if not bound or completes:
            return True
        return self._partials_after(running, step) + 1 <= bound

    def _partials_after(self, running: Sequence[Request], step: StepState) -> int:
        """Running requests still short of their prefill end once this step's tokens land."""
        count = self.new_partials
        scheduled, admitted = step.scheduled, step.admitted
        for request in running:
            if admitted and request.req_id in admitted:
                continue  # counted in new_partials
            done = request.num_computed_tokens + scheduled.get(request.req_id, 0)
            if done < request.prefill_end:
                count += 1
        return count

    def charge(self, num_new: int, *, completes: bool) -> None:
        """An admission took `num_new` tokens; it is a new partial prefill unless it completes."""
        if self.waiter_tokens is not None:
            used = prefill_work(num_new, self.start, self.decision.context_tokens)
            self.waiter_tokens -= math.ceil(used)
        if not completes:
            self.new_partials += 1

    def reclaim(self, running: Sequence[Request], step: StepState, take_more: TakeMore) -> None:
        """Give the quanta the head waiter could not use back to the running partial prefills,
        in running order, while tokens and budget last; `take_more` aligns and allocates."""
        if self.decision.grants is None or not self.waiter_tokens:
            return
        left = self.waiter_tokens
        context_tokens = self.decision.context_tokens
        for request in running:
            if left <= 0 or step.budget <= 0:
                break
            if request.req_id in step.admitted or is_decode(request):
                continue
            already = step.scheduled.get(request.req_id, 0)
            remaining = request.num_tokens - request.num_computed_tokens
            start = request.num_computed_tokens + already
            fit = tokens_within(left, start, context_tokens)
            extra = take_more(
                request, already, min(already + fit, remaining, already + step.budget)
            )
            if extra is None:
                break
            left -= math.ceil(prefill_work(extra, start, context_tokens))
        self.waiter_tokens = left


@dataclass(slots=True)
class ControlStats:
    """SPEC.md 6.3 counters."""

    governed_prefill_tokens: int = 0
    decode_only_steps_while_pending: int = 0
    deadline_bypasses: int = 0
    adaptive_fallbacks: int = 0
    queue_pressure_steps: int = 0  # mixed steps decided with the adaptive queue valve open
    # mixed steps the adaptive budget stood aside for (decode-only steps ran past its target)
    adaptive_stand_aside_steps: int = 0
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
            (
                "hybridserve:scheduler_queue_pressure_steps_total",
                "counter",
                self.queue_pressure_steps,
            ),
            (
                "hybridserve:scheduler_adaptive_stand_aside_steps_total",
                "counter",
                self.adaptive_stand_aside_steps,
            ),
        ]


class PrefillController:
    """The prefill/decode controls of one scheduler.

    Its state changes in three calls only, once per step each: `decide_and_commit` (the
    rotation pointer, the grants and fallbacks it records), `observe` (the decode-burst count
    and the counters, after the step is scheduled) and `learn` (the step-time model, after the
    step ran). `decide` is its pure part.
    """

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
        self.adaptive = (
            AdaptiveBudget(config, quantum=quantum) if config.adaptive_budget_itl_ms > 0 else None
        )
        # The context weight sizes the adaptive budget's own in-order grants only.
        weighs = config.adaptive_budget_context_weight and not (self.cap or self.target_s)
        self.context = ContextWeight() if weighs else None
        self.enabled = bool(
            self.cap
            or self.max_partials
            or self.min_decode_steps
            or self.target_s
            or self.adaptive is not None
        )
        self.since = 0  # decode-only steps since the last prefill release, saturating at D
        self.rot = 0
        self.stats = ControlStats()
        self._last_decision = UNLIMITED  # the decision of the step `learn` hears about next

    # ----- decide -----------------------------------------------------------------------------

    def decide_and_commit(
        self,
        *,
        now: float,
        running: Sequence[Request],
        waiting: Sequence[Request],
        token_budget: int,
        seq_slot_free: bool,
    ) -> PrefillDecision:
        """Decide the step and commit the decision (this advances the rotation pointer, records the
        grants and counts a fallback): call it once per step, before the running loop."""
        if not self.enabled:
            return UNLIMITED
        decision = self.decide(
            now=now,
            running=running,
            waiting=waiting,
            token_budget=token_budget,
            seq_slot_free=seq_slot_free,
        )
        self.commit(decision)
        return decision

    def decide(
        self,
        *,
        now: float,
        running: Sequence[Request],
        waiting: Sequence[Request],
        token_budget: int,
        seq_slot_free: bool,
    ) -> PrefillDecision:
        """The step's decision from the controller's current state. Pure: it changes nothing."""
        if not self.enabled:
            return UNLIMITED
        decodes = [r for r in running if is_decode(r)]
        partials = [r for r in running if not is_decode(r)]
        pending = bool(partials) or bool(waiting)
        bound = self.max_partials
        if not decodes:  # nothing to protect: the full budget
            return PrefillDecision(max_partials=bound, pending=pending)
        burst, bypass = self._in_burst(now, waiting, pending)
        if burst:
            return PrefillDecision(
                allow_prefill=False, max_partials=bound, eligible_decode=True, pending=pending
            )
        decode_tokens = sum(r.num_tokens_with_drafts - r.num_computed_tokens for r in decodes)
        oldest, pressure = self._oldest_wait(now, waiting, partials, pending)
        room = token_budget - decode_tokens
        context_tokens = self.context.context_tokens() if self.context is not None else 0.0
        budget, fallback = self._mixed_budget(room, decodes, partials, weighted=context_tokens > 0)
        if self._adaptive_alone_covers(room, partials, waiting, context_tokens):
            # The adaptive budget at the whole room does not bind: vLLM's loop spends it (a
            # budget floored to quanta would take up to a quantum less than vLLM every step).
            return replace(
                UNLIMITED_MIXED, max_partials=bound, bypass=bypass, pending=pending,
                mixed_budget=max(room, 0), queue_pressure=pressure, oldest_wait_s=oldest,
            )  # fmt: skip
        if budget is None:  # only Mp / D / W are on: no token cap
            return PrefillDecision(
                max_partials=bound, bypass=bypass, eligible_decode=True, pending=pending
            )
        if self.cap or self.target_s:
            grants, rotation, waiter_tokens = self._share(budget, partials, waiting, seq_slot_free)
        else:  # the adaptive budget alone: vLLM's order, the oldest prefill first
            grants, waiter_tokens = self._in_order(budget, partials, context_tokens)
            rotation = None
        return PrefillDecision(
            grants=MappingProxyType(grants),
            waiter_tokens=waiter_tokens,
            max_partials=bound,
            bypass=bypass,
            eligible_decode=True,
            pending=pending,
            mixed_budget=budget,
            rotation=rotation,
            adaptive_fallback=fallback,
            queue_pressure=pressure,
            oldest_wait_s=oldest,
            adaptive_step=self.adaptive is not None,
            context_tokens=context_tokens,
            min_prefill_tokens=self.adaptive.floor if self.adaptive is not None else 0,
        )

    def _in_burst(self, now: float, waiting: Sequence[Request], pending: bool) -> tuple[bool, bool]:
        """(the step is a decode burst's, the oldest-waiter deadline bypasses the burst)."""
        if not (self.min_decode_steps and pending and self.since < self.min_decode_steps):
            return False, False
        if self.max_wait_s > 0 and _oldest_age(waiting, now) >= self.max_wait_s:
            return False, True
        return True, False

    def _oldest_wait(
        self, now: float, waiting: Sequence[Request], partials: Sequence[Request], pending: bool
    ) -> tuple[float, bool]:
        """The oldest prefill's wait and whether the queue valve is open. Only the adaptive
        budget reads them (its valve and its calm target), so nothing else scans the queue."""
        if not pending or self.adaptive is None:
            return 0.0, False
        oldest = max(_oldest_age(waiting, now), _oldest_age(partials, now))
        return oldest, self.adaptive.under_pressure(oldest)

    def _adaptive_alone_covers(
        self,
        room: int,
        partials: Sequence[Request],
        waiting: Sequence[Request],
        context_tokens: float,
    ) -> bool:
        """Only the adaptive budget caps prefill, and it reaches the step's whole room (under
        the context weight, the room's `prefill_work` at the longest context the step could
        meet: at least the room, so the queue is scanned only when the room is covered)."""
        if self.adaptive is None or self.cap or self.target_s:
            return False
        if self.adaptive.stands_aside:  # the decodes alone miss its target: vLLM's step
            return True
        if not self.adaptive.covers(room):
            return False
        if context_tokens <= 0:
            return True
        return self.adaptive.covers(_room_work(room, partials, waiting, context_tokens))

    def commit(self, decision: PrefillDecision) -> None:
        """Advance the controller by a decision `decide` returned, for the step that runs it."""
        if decision.rotation is not None:
            self.rot = decision.rotation
        if decision.adaptive_fallback:
            self.stats.adaptive_fallbacks += 1
        if decision.grants is not None:
            self.stats.last_grants = dict(decision.grants)
        if decision.queue_pressure:
            self.stats.queue_pressure_steps += 1
        if self.adaptive is not None and decision.adaptive_step:
            self.adaptive.valve_open = decision.queue_pressure
            if self.adaptive.stands_aside and decision.pending:
                self.stats.adaptive_stand_aside_steps += 1
        self._last_decision = decision

    def _mixed_budget(
        self,
        room: int,
        decodes: Sequence[Request],
        partials: Sequence[Request],
        *,
        weighted: bool = False,
    ) -> tuple[int | None, bool]:
        """Bp (None: no cap is on), the token cap and/or the adaptive time grant floored to the
        quantum; and whether the time grant fell back. A `weighted` budget (the context weight,
        the adaptive budget alone) is in weighted tokens: the step's room in tokens does not
        bound it (the running loop and the admissions still stop at the room)."""
        if not self.cap and not self.target_s and self.adaptive is None:
            return None, False
        if weighted and self.adaptive is not None:
            return self.adaptive.tokens() // self.quantum * self.quantum, False
        limit = max(room, 0)
        if self.cap:
            limit = min(limit, self.cap)
        if self.adaptive is not None and not self.adaptive.stands_aside:
            limit = min(limit, self.adaptive.tokens())
        fallback = False
        if self.target_s:
            # At least one quantum: prefill never starves (a deadline bypass always moves),
            # and a mixed step exceeds T by at most one quantum's cost.
            grant, fallback = self._adaptive_grant(decodes, partials)
            limit = min(limit, max(grant, self.quantum))
        return limit // self.quantum * self.quantum, fallback

    def _adaptive_grant(
        self, decodes: Sequence[Request], partials: Sequence[Request]
    ) -> tuple[int, bool]:
        """The largest prefill (a multiple of q) predicted to keep the mixed step within T, and
        whether it fell back to the cap (or one quantum) because predictions are poor."""
        model = self.model
        if model.recent_error > FALLBACK_ERROR:
            return (self.cap if self.cap else self.quantum), True
        n_decode = sum(r.num_tokens_with_drafts - r.num_computed_tokens for r in decodes)
        kv_decode = sum(r.num_computed_tokens for r in decodes)
        base = model.predict(model.features(n_decode, 0, kv_decode))
        context = sum(r.num_computed_tokens for r in partials) / len(partials) if partials else 0
        c = model.theta
        per_token = c[2] + c[3] * context
        slack = self.target_s - base
        if slack <= 0:
            return 0, False
        tokens = slack / per_token if per_token > 0 else math.inf
        if not math.isfinite(tokens):
            return 1 << 30, False  # no per-token cost learned: only the step cap binds
        return int(tokens) // self.quantum * self.quantum, False

    def _share(
        self,
        budget: int,
        partials: Sequence[Request],
        waiting: Sequence[Request],
        seq_slot_free: bool,
    ) -> tuple[dict[str, int], int | None, int]:
        """Bp in quanta: one reserved for the head waiter when it could start (a free sequence
        slot, fewer than Mp partial prefills), the rest rotated over the partial prefills; the
        waiter also gets the whole quanta they cannot use. (grants, rotation, waiter tokens)."""
        quanta = budget // self.quantum
        partial_free = not self.max_partials or len(partials) < self.max_partials
        reserve = 1 if (waiting and seq_slot_free and partial_free and quanta > 0) else 0
        grants, rotation = self._rotate(partials, quanta - reserve)
        unused = sum(
            max(grants[r.req_id] - (r.num_tokens - r.num_computed_tokens), 0) for r in partials
        )
        return grants, rotation, reserve * self.quantum + unused // self.quantum * self.quantum

    def _in_order(
        self, budget: int, partials: Sequence[Request], context_tokens: float = 0.0
    ) -> tuple[dict[str, int], int]:
        """Bp as vLLM's loop would spend it: the running partial prefills in running order, each
        as much as it needs (in whole quanta, unless it completes), then the waiters what is
        left. Under the context weight (S0 = `context_tokens` > 0) a prefill's chunk takes its
        `prefill_work` of Bp (its tokens plus its (query, key) pairs over S0), and the first
        prefill may always take the budget's floor. (grants, waiter tokens)."""
        q = self.quantum
        left = budget
        grants = {}
        for request in partials:
            remaining = request.num_tokens - request.num_computed_tokens
            if context_tokens > 0:
                start = request.num_computed_tokens
                fit = tokens_within(left, start, context_tokens)
                if left == budget and self.adaptive is not None:
                    fit = max(fit, min(self.adaptive.floor, budget))
                grant = remaining if remaining <= fit else fit // q * q
                left = max(left - math.ceil(prefill_work(grant, start, context_tokens)), 0)
            else:
                grant = remaining if remaining <= left else left // q * q
                left -= grant
            grants[request.req_id] = grant
        return grants, left // q * q

    def _rotate(
        self, partials: Sequence[Request], quanta: int
    ) -> tuple[dict[str, int], int | None]:
        """Equal shares of the quanta; the remainder goes to consecutive requests from `rot`.
        Also the pointer the next rotation starts from (None: it stays)."""
        if not partials or quanta <= 0:
            return {r.req_id: 0 for r in partials}, None
        share, extra = divmod(quanta, len(partials))
        start = self.rot % len(partials)
        grants = {}
        for offset in range(len(partials)):
            request = partials[(start + offset) % len(partials)]
            grants[request.req_id] = (share + (1 if offset < extra else 0)) * self.quantum
        return grants, (start + (extra if extra else 1)) % len(partials)

    # ----- observe ------------------------------------------------------------------------------

    def observe(
        self, decision: PrefillDecision, *, prefill_tokens: int, partials_after: int
    ) -> None:
        """Advance the decode-burst count and the counters by a scheduled step: it ran
        `decision`, carried `prefill_tokens` and left `partials_after` partial prefills."""
        if not self.enabled:
            return
        stats = self.stats
        stats.active_partial_prefills = partials_after
        if not decision.eligible_decode:
            self.since = 0
        elif prefill_tokens:
            self.since = 0
            stats.governed_prefill_tokens += prefill_tokens
            if decision.bypass:
                stats.deadline_bypasses += 1
        else:
            self.since = min(self.since + 1, self.min_decode_steps)
            if decision.pending:
                stats.decode_only_steps_while_pending += 1

    def learn(
        self,
        *,
        decode: int,
        prefill: int,
        kv_tokens_read: int,
        duration_s: float,
        shape: SchedulerOutput | None = None,
    ) -> None:
        """Feed a finished step's measured (or simulated) duration to the step-time models and
        to the adaptive budget (a step that carried decodes under a token budget). `shape` (the
        step's output) carries what the context weight reads: the decodes' context, the prefill
        chunks' starts and pairs."""
        if self.target_s and duration_s > 0:
            self.model.update(self.model.features(decode, prefill, kv_tokens_read), duration_s)
        if self.context is not None and shape is not None:
            self.context.learn(
                decode=decode,
                decode_kv=shape.decode_kv_tokens,
                prefill=prefill,
                prefill_pairs=shape.prefill_pairs,
                duration_s=duration_s,
            )
        decision, self._last_decision = self._last_decision, UNLIMITED
        if self.adaptive is not None and decode and not prefill:
            self.adaptive.observe_decode_only(duration_s)
        if self.adaptive is not None and decode and decision.adaptive_step:
            used, unit = float(prefill), 1.0
            s0 = decision.context_tokens
            if s0 > 0 and shape is not None:  # the budget it took, in weighted tokens
                used += shape.prefill_pairs / s0
                q = self.quantum
                unit = prefill_work(q, shape.max_prefill_start, s0) / q
            self.adaptive.update(
                duration_s=duration_s,
                prefill_tokens=used,
                budget=decision.mixed_budget,
                pressure=decision.queue_pressure,
                oldest_wait_s=decision.oldest_wait_s,
                unit=unit,
            )


def _room_work(
    room: int, partials: Sequence[Request], waiting: Sequence[Request], context_tokens: float
) -> float:
    """The step's whole room under the context weight (S0 = `context_tokens` > 0), at the
    longest context a prefill of this step could start from: a partial's computed tokens, a
    waiter's whole prompt (its hit is not looked up yet)."""
    longest = max(
        max((r.num_computed_tokens for r in partials), default=0),
        max((r.num_tokens for r in waiting), default=0),
    )
    return prefill_work(room, longest, context_tokens)


def _oldest_age(waiting: Sequence[Request], now: float) -> float:
    return max((now - r.arrival_time for r in waiting), default=0.0)
