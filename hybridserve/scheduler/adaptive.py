"""The adaptive prefill budget: how many prefill tokens a step that carries decodes may take,
moved by what the engine measures rather than fixed by one workload's tuning. Off unless
`adaptive_budget_itl_ms` > 0; `PrefillController` asks it for the budget and feeds it each
step's duration.

A step that carries decodes is one inter-token gap for every request it decodes, so its duration
is what the ITL SLO sees. The budget P (prefill tokens of such a step) moves multiplicatively
after each one, by the ratio of the target T to the measured duration d:

* down when the step ran past T: P <- P * max(T / d, 1/2). A step costs about a + b * P (a the
  decodes' share), so this lands at (T - a) / b within a few steps, from either side;
* up when it stayed under T and the budget bound (prefill work was left for later):
  P <- P * min(T / d, 5/4), at least one quantum more, but never to or past a budget predicted
  past 11/10 of the aim. Growth measures what it bought: when a binding step follows one with a
  smaller budget, their difference over the tokens between is a cost a prefill token, kept per
  budget as a running average and forgotten `LEVEL_MEMORY_STEPS` updates after its last step;
  a budget B' it was measured at is predicted at d + cost x (B' - P). A quantum of a hybrid
  model's state block is hundreds of tokens: without this, a budget whose next quantum
  overshoots the aim climbs to it after every step under T and back after every step over, so
  every other mixed step runs past it. The cost is measured, not modelled: a long prompt's later
  chunks cost more a token (their attention reads the chunks before them), and the decodes'
  share, which moves with the batch, cancels out of the difference;
* up by 5/4 per step, whatever the step time, while the oldest request still in its prefill
  (waiting, or a partial prefill) has waited past the queue limit W and the budget binds: when
  arrivals outgrow the prefill that T allows, the engine trades ITL for time to first token
  instead of letting every waiter miss it, up to vLLM's whole token budget. W = 0 turns this
  valve off. With a pressure limit Tp (`adaptive_budget_pressure_itl_ms` > 0), the open valve
  instead moves P towards steps of Tp by the two rules above: the budget still grows for the
  queue, but never past the step time the ITL SLO allows. Growth under that limit stops under
  a budget predicted past PRESSURE_LEVEL_LIMIT x Tp, not 11/10 of it: Tp is already the SLO
  less the margin its p99 needs, and the tolerance would spend that margin (the valve runs its
  steps at Tp for minutes at a time, so the steps that growth mispredicts become the p99).

With a calm target Tc (`adaptive_budget_calm_itl_ms` > 0), T is where the aim ends, not where
it starts: steps aim for Tc while the oldest request in prefill has not waited, and for
Tc + (T - Tc) * min(2a / W, 1) when it has waited a (T from W/2 on, before the valve opens).
A short queue costs no gap past Tc; a queue that waits buys the longer steps it needs before
the valve opens.

The valve has hysteresis: it opens when the oldest waiter has waited W and closes only when the
oldest has waited less than W/4. Without it, a load past saturation holds the queue at W: the
budget grows, the wait dips under W, the budget learns down and the queue grows back, at a
throughput below vLLM's whole budget, and every waiter pays W more.

P stays within [floor, max_num_batched_tokens] and is handed out in whole quanta (q, the state
block; SPEC.md 5.2). It starts at max_num_batched_tokens, vLLM's budget, and learns down.

The budget stands aside while the decodes alone run past T: when the running average of the
steps that carried decodes and no prefill (`observe_decode_only`) reaches T, no prefill budget
can bring a mixed step under it, and shrinking the prefill only delays first tokens and splits
prompts into smaller, costlier chunks. Steps are then vLLM's own (the budget at vLLM's, not
updated) until that average falls under DECODE_ONLY_RELEASE x T. It happens where the engine is
slow against the target (a CPU serving Gemma 3 270M to 8 streams decodes in 84 ms a step
against T = 75: the budget fell to its floor, one 256-token prompt a 300 ms step, where vLLM
prefills the queue in one 2,048-token step), not where T was chosen (the simulated H200).

It stands aside too while the floor itself runs past every aim it has: when the running average
of the mixed steps that used the whole floor (FLOOR_MIN_STEPS of them at least) reaches the
larger of T and Tp, the decodes may be fast but one floor of prefill is not, and a budget held
at the floor only splits the queue's prompts into more steps, each of which carries every decode
and misses the aim anyway (a CPU serving SmolLM2 prefills 256 tokens in about 0.37 s against
T = 75 ms: the preset ran 127 mixed steps of 390 prompt tokens where vLLM ran 52 of 991, and
finished fewer requests). No step time says when a floor would fit again, so after
FLOOR_RETRY_STEPS steps of vLLM's that carried prefill it tries: it learns down from vLLM's
budget, and stands aside again if the floor's steps still miss.
"""

from __future__ import annotations

import math

from hybridserve.core.config import SchedulerConfig

MAX_STEP_UP = 1.25  # the most one step may grow the budget by
MAX_STEP_DOWN = 0.5  # the most one step may shrink it by
MIN_BUDGET_TOKENS = 256  # the floor, rounded down to whole quanta (at least one quantum)
VALVE_CLOSE_FRACTION = 0.25  # an open valve closes when the oldest wait falls under W/4
LEVEL_LIMIT = 1.1  # growth stops a quantum under a budget predicted past this x the aim
PRESSURE_LEVEL_LIMIT = 1.025  # the same under the open valve's step-time limit Tp, x Tp
LEVEL_WEIGHT = 0.25  # the weight of the newest measured cost a token in a budget's average
LEVEL_MEMORY_STEPS = 200  # a budget's cost is forgotten this many updates after its last step
CONTEXT_CEILING_FACTOR = 32  # the weighted budget's ceiling, x max_num_batched_tokens
CALM_RISE_FRACTION = 0.5  # a calm aim reaches T when the oldest wait reaches W/2
DECODE_ONLY_WEIGHT = 0.25  # the newest decode-only step's weight in their running average
DECODE_ONLY_RELEASE = 0.9  # a budget standing aside resumes under this x T of decode-only steps
FLOOR_WEIGHT = 0.25  # the newest floor step's weight in their running average
FLOOR_MIN_STEPS = 3  # floor steps heard (since the last try) before they can make it stand aside
FLOOR_RETRY_STEPS = 64  # prefill-carrying steps of vLLM's before a budget aside for its floor tries


class AdaptiveBudget:
    """The prefill budget of mixed steps, fed by measured step durations."""

    __slots__ = (
        "calm_target_s",
        "ceiling",
        "decode_aside",
        "decode_only_s",
        "floor",
        "floor_aside",
        "floor_s",
        "floor_steps",
        "last_binding",
        "levels",
        "pressure_target_s",
        "quantum",
        "queue_limit_s",
        "retry_in",
        "start_tokens",
        "target_s",
        "tokens_f",
        "updates",
        "valve_open",
    )

    def __init__(self, config: SchedulerConfig, *, quantum: int) -> None:
        self.target_s = config.adaptive_budget_itl_ms / 1000.0
        self.queue_limit_s = config.adaptive_budget_queue_ms / 1000.0
        self.pressure_target_s = config.adaptive_budget_pressure_itl_ms / 1000.0
        self.calm_target_s = config.adaptive_budget_calm_itl_ms / 1000.0
        self.quantum = quantum
        # Under the context weight the budget is in weighted tokens: a step of
        # max_num_batched_tokens at a long context weighs many times that.
        self.ceiling = config.max_num_batched_tokens * (
            CONTEXT_CEILING_FACTOR if config.adaptive_budget_context_weight else 1
        )
        self.floor = min(max(MIN_BUDGET_TOKENS // quantum, 1) * quantum, self.ceiling)
        # It starts at vLLM's budget and learns down (under the context weight too: the
        # ceiling above is room to grow into, not a start that takes more steps to leave).
        self.start_tokens = float(config.max_num_batched_tokens)
        self.tokens_f = self.start_tokens
        # The running average of decode-only steps (0: none yet), and whether it is past T.
        self.decode_only_s = 0.0
        self.decode_aside = False
        # The running average of the steps that used the whole floor, how many were heard, and
        # whether it is past every aim (then `retry_in` prefill-carrying steps until it tries).
        self.floor_s = 0.0
        self.floor_steps = 0
        self.floor_aside = False
        self.retry_in = 0
        self.valve_open = False  # set by the controller from the decision of each mixed step
        # budget -> (running average of the measured cost a prefill token of growing to it,
        # `updates` at its last step); the last binding step's (budget, duration, `updates`)
        self.levels: dict[int, tuple[float, int]] = {}
        self.last_binding: tuple[int, float, int] | None = None
        self.updates = 0

    def _record(self, budget: int, duration_s: float) -> None:
        """A step that used its whole `budget` (within a quantum) ran `duration_s`. When the
        update just before was such a step with a smaller budget (the same decodes, near
        enough), their difference is a measured cost a prefill token: `budget`'s running
        average of it. Averages not updated for LEVEL_MEMORY_STEPS updates are forgotten."""
        last = self.last_binding
        self.last_binding = (budget, duration_s, self.updates)
        if last is None or last[2] != self.updates - 1 or last[0] >= budget:
            return
        per_token = (duration_s - last[1]) / (budget - last[0])
        seen = self.levels.get(budget)
        if seen is not None and self.updates - seen[1] <= LEVEL_MEMORY_STEPS:
            per_token = seen[0] + LEVEL_WEIGHT * (per_token - seen[0])
        self.levels[budget] = (per_token, self.updates)
        if len(self.levels) > LEVEL_MEMORY_STEPS:  # at most one entry per update remembered
            stale = self.updates - LEVEL_MEMORY_STEPS
            self.levels = {b: seen for b, seen in self.levels.items() if seen[1] >= stale}

    def _open_below(self, tokens: float, budget: int, duration_s: float, limit: float) -> float:
        """`tokens`, or less: growth from `budget`, whose step just ran `duration_s`, stops a
        quantum under the smallest larger budget predicted past `limit` seconds (a larger
        budget than that would run longer still), and never falls under `budget`. A budget
        that growth reached recently is predicted from its measured cost a token."""
        stale = self.updates - LEVEL_MEMORY_STEPS
        closed = [
            level
            for level, (per_token, at) in self.levels.items()
            if budget < level <= tokens
            and at >= stale
            and duration_s + per_token * (level - budget) > limit
        ]
        if not closed:
            return tokens
        return float(max(min(closed) - self.quantum, budget))

    def observe_decode_only(self, duration_s: float) -> None:
        """A step that carried decodes and no prefill ran `duration_s`: the budget stands aside
        once their running average reaches T, and resumes (from vLLM's budget, learning down
        again) once it falls under DECODE_ONLY_RELEASE x T."""
        if duration_s <= 0:
            return
        seen = self.decode_only_s
        self.decode_only_s = (
            duration_s if seen <= 0 else seen + DECODE_ONLY_WEIGHT * (duration_s - seen)
        )
        if self.decode_only_s >= self.target_s:
            self._step_aside()
            self.decode_aside = True
        elif self.decode_only_s < DECODE_ONLY_RELEASE * self.target_s:
            self.decode_aside = False

    @property
    def stands_aside(self) -> bool:
        """Steps are vLLM's: the decodes alone, or the floor's steps, run past the aim."""
        return self.decode_aside or self.floor_aside

    def _step_aside(self) -> None:
        if not self.stands_aside:
            self.tokens_f = max(self.tokens_f, self.start_tokens)

    def _observe_floor(self, duration_s: float) -> None:
        """A mixed step that used the whole floor ran `duration_s`: the budget stands aside
        for FLOOR_RETRY_STEPS once their running average reaches the larger of T and Tp."""
        seen = self.floor_s
        self.floor_s = duration_s if seen <= 0 else seen + FLOOR_WEIGHT * (duration_s - seen)
        self.floor_steps += 1
        if self.floor_steps >= FLOOR_MIN_STEPS and self.floor_s >= max(
            self.target_s, self.pressure_target_s
        ):
            self._step_aside()
            self.floor_aside = True
            self.retry_in = FLOOR_RETRY_STEPS

    def _aside_step(self, prefill_tokens: float) -> None:
        """A step of vLLM's while the budget stands aside for its floor: after
        FLOOR_RETRY_STEPS of them that carried prefill, it tries the floor again (its floor
        steps heard afresh)."""
        if not self.floor_aside or prefill_tokens <= 0:
            return
        self.retry_in -= 1
        if self.retry_in <= 0:
            self.floor_aside = False
            self.floor_s = 0.0
            self.floor_steps = 0

    def tokens(self) -> int:
        """The budget now: whole quanta, at least one, at most max_num_batched_tokens."""
        whole = int(self.tokens_f) // self.quantum * self.quantum
        return min(max(whole, self.floor), self.ceiling)

    def covers(self, room: float) -> bool:
        """The budget (before rounding to quanta) reaches `room`, a step's whole prefill room:
        it does not bind, and the step is vLLM's."""
        return self.tokens_f >= room

    def under_pressure(self, oldest_wait_s: float) -> bool:
        """The queue valve: the oldest waiter has waited past W (past W/4 once it is open)."""
        if self.queue_limit_s <= 0:
            return False
        limit = self.queue_limit_s * (VALVE_CLOSE_FRACTION if self.valve_open else 1.0)
        return oldest_wait_s >= limit

    def target(self, oldest_wait_s: float) -> float:
        """The step time aimed for when the oldest request in prefill has waited that long: T,
        or with a calm target Tc, the line from Tc (no wait) to T (a wait of W/2)."""
        if self.calm_target_s <= 0:
            return self.target_s
        rise = min(oldest_wait_s / (self.queue_limit_s * CALM_RISE_FRACTION), 1.0)
        return self.calm_target_s + (self.target_s - self.calm_target_s) * rise

    def update(
        self,
        *,
        duration_s: float,
        prefill_tokens: float,
        budget: int,
        pressure: bool,
        oldest_wait_s: float = 0.0,
        unit: float = 1.0,
    ) -> None:
        """Move the budget by one step that carried decodes: it ran `duration_s`, took
        `prefill_tokens` of its `budget` (weighted by context, see ContextWeight; a quantum more
        would have taken `unit` quanta) and was planned `pressure`d (the queue valve open) when
        the oldest request in prefill had waited `oldest_wait_s`."""
        if duration_s <= 0:
            return
        if self.stands_aside:
            self._aside_step(prefill_tokens)
            return
        self.updates += 1
        limited = pressure and self.pressure_target_s > 0
        if limited:  # the open valve under its step-time limit: the rules below, towards Tp
            pressure = False
        aim = self.pressure_target_s if limited else self.target(oldest_wait_s)
        ratio = aim / duration_s
        binds = prefill_tokens + self.quantum * unit > budget
        if binds:
            self._record(budget, duration_s)
            if budget <= self.floor:
                self._observe_floor(duration_s)
                if self.floor_aside:
                    return
        if ratio < 1.0 and not pressure:
            tokens = budget * max(ratio, MAX_STEP_DOWN)
        elif binds and (pressure or ratio > 1.0):
            # From the budget the step had; at least a quantum more, so flooring never sticks.
            factor = MAX_STEP_UP if pressure else min(ratio, MAX_STEP_UP)
            tokens = max(budget * factor, float(budget + self.quantum))
            if not pressure:  # growth towards a step time: not to a budget predicted past it
                limit = (PRESSURE_LEVEL_LIMIT if limited else LEVEL_LIMIT) * aim
                tokens = self._open_below(tokens, budget, duration_s, limit)
        else:
            return
        self.tokens_f = min(max(tokens, float(self.floor)), float(self.ceiling))


# The context weight's step-time fit: features (1, decode tokens, decode context tokens, prefill
# tokens, prefill (query, key) pairs), scaled to similar magnitudes.
CONTEXT_SCALES = (1.0, 1e-2, 1e-6, 1e-3, 1e-8)
CONTEXT_FORGETTING = 0.995  # each step's weight in the fit: about the last 200 steps
CONTEXT_MIN_STEPS = 32  # prefill-carrying steps heard before the weight applies
CONTEXT_REFIT_STEPS = 16  # S0 is solved again after this many steps
CONTEXT_RIDGE = 1e-6  # x the mean diagonal: keeps a feature that did not move from blowing up
MIN_CONTEXT_TOKENS = 1_024.0  # S0 is never taken under this (a weight of 2 at 1k tokens)


class ContextWeight:
    """The context weight: a prefill chunk of n tokens from position s takes
    n + (n s + n (n + 1) / 2) / S0 of the adaptive budget (`prefill_work`).

    Such a chunk attends n s + n (n + 1) / 2 (query, key) pairs: on a long agent context most
    of its time is attention, and a token budget that learned its size on short contexts runs
    far past its aim on a 100k-token one. Counting the pairs too, the budget is in tokens of
    what they cost at context 0, whatever the context of the chunk it is spent on. S0 is the
    context at which a token's attention costs what the rest of its prefill costs: the ratio of
    two coefficients of a least-squares fit of the steps' times (every step that ran, forgotten
    by CONTEXT_FORGETTING a step) on the decode tokens and their context, the prefill tokens
    and their pairs. The fit keeps exponentially weighted sums and solves its normal equations
    (with a small ridge) every CONTEXT_REFIT_STEPS steps. Until it has heard
    CONTEXT_MIN_STEPS steps that carried prefill, or while it finds no positive cost for
    either prefill term, S0 is unknown (0) and every weight is 1: the budget counts tokens.
    """

    __slots__ = ("_s0", "_since_fit", "_xtx", "_xty", "prefill_steps")

    def __init__(self) -> None:
        n = len(CONTEXT_SCALES)
        self._xtx = [[0.0] * n for _ in range(n)]
        self._xty = [0.0] * n
        self.prefill_steps = 0
        self._since_fit = 0
        self._s0 = 0.0

    def learn(
        self,
        *,
        decode: int,
        decode_kv: int,
        prefill: int,
        prefill_pairs: int,
        duration_s: float,
    ) -> None:
        """Feed one step that ran `duration_s`."""
        if duration_s <= 0:
            return
        raw = (1.0, decode, decode_kv, prefill, prefill_pairs)
        z = [v * k for v, k in zip(raw, CONTEXT_SCALES, strict=True)]
        lam = CONTEXT_FORGETTING
        for i, zi in enumerate(z):
            row = self._xtx[i]
            for j, zj in enumerate(z):
                row[j] = lam * row[j] + zi * zj
            self._xty[i] = lam * self._xty[i] + zi * duration_s
        if prefill:
            self.prefill_steps += 1
        self._since_fit += 1

    def context_tokens(self) -> float:
        """S0, or 0 while it is unknown (every weight is then 1)."""
        if self.prefill_steps < CONTEXT_MIN_STEPS:
            return 0.0
        if self._since_fit >= CONTEXT_REFIT_STEPS or not self._s0:
            self._since_fit = 0
            self._s0 = self._fit()
        return self._s0

    def _fit(self) -> float:
        theta = _solve_ridge(self._xtx, self._xty, CONTEXT_RIDGE)
        if theta is None:
            return 0.0
        per_token = theta[3] * CONTEXT_SCALES[3]
        per_pair = theta[4] * CONTEXT_SCALES[4]
        if per_token <= 0 or per_pair <= 0:
            return 0.0
        return max(per_token / per_pair, MIN_CONTEXT_TOKENS)


def _solve_ridge(xtx: list[list[float]], xty: list[float], ridge: float) -> list[float] | None:
    """(XtX + ridge * mean diagonal * I)^-1 Xty by Gaussian elimination with partial pivoting;
    None when the system is empty or singular."""
    n = len(xty)
    shift = ridge * sum(xtx[i][i] for i in range(n)) / n
    if not shift > 0:
        return None
    a = [[*xtx[i][:i], xtx[i][i] + shift, *xtx[i][i + 1 :], xty[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        head = a[col]
        for r in range(col + 1, n):
            factor = a[r][col] / head[col]
            if factor:
                row = a[r]
                for k in range(col, n + 1):
                    row[k] -= factor * head[k]
    theta = [0.0] * n
    for i in range(n - 1, -1, -1):
        theta[i] = (a[i][n] - sum(a[i][k] * theta[k] for k in range(i + 1, n))) / a[i][i]
    return theta if all(math.isfinite(v) for v in theta) else None


def prefill_work(tokens: int, start: int, context_tokens: float) -> float:
    """The budget a prefill chunk of `tokens` from position `start` takes under the context
    weight S0 = `context_tokens`: its tokens plus its (query, key) pairs over S0, what the fit
    predicts it costs in tokens at context 0. `tokens` itself when S0 is unknown (0)."""
    if context_tokens <= 0 or tokens <= 0:
        return float(max(tokens, 0))
    return tokens + (tokens * start + tokens * (tokens + 1) / 2) / context_tokens


def tokens_within(work: float, start: int, context_tokens: float) -> int:
    """The most tokens a prefill from `start` may take within `work` (prefill_work's inverse,
    rounded down); int(work) when S0 is unknown."""
    if work <= 0:
        return 0
    if context_tokens <= 0:
        return int(work)
    # n^2 / (2 S0) + n (1 + (start + 1/2) / S0) = work
    slope = 1.0 + (start + 0.5) / context_tokens
    n = int(context_tokens * (math.sqrt(slope * slope + 2.0 * work / context_tokens) - slope))
    while n > 0 and prefill_work(n, start, context_tokens) > work:
        n -= 1
    while prefill_work(n + 1, start, context_tokens) <= work:
        n += 1
    return n
