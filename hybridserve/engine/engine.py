"""Engine.step(): schedule, execute, update, outputs. Time is passed in; no wall clock here.

Faults stay inside the step that caused them:

- The executor raises: every request of the step is aborted and its blocks freed, the blocks
  they held leave the prefix cache (their K/V or state may be partly written), the cache
  invariants are checked, and `step` raises `StepFailed` naming those requests. The engine can
  go on stepping the others; the finished ids the executor never saw go with the next plan.
- The executor returns no token for a chunk that samples, or a token id outside the
  vocabulary: that request alone is aborted and listed in `EngineStep.failed`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from hybridserve.core.errors import HybridServeError
from hybridserve.core.plan import StepPlan, StepResult
from hybridserve.core.request import Request, RequestStatus
from hybridserve.executor.api import Executor
from hybridserve.scheduler import Scheduler, SchedulerOutput
from hybridserve.scheduler.scheduler import RequestOutput


class Admission(NamedTuple):
    """A request admitted for the first time this step (not a resumption)."""

    req_id: str
    arrival_time: float
    num_prompt_tokens: int
    # Prompt tokens the prefix cache served at this first admission (vLLM's
    # `num_cached_tokens`, reported as `usage.prompt_tokens_details.cached_tokens`).
    num_cached_tokens: int = 0


class RequestFailure(NamedTuple):
    """A request the engine aborted because its executor output was unusable."""

    req_id: str
    reason: str  # what was wrong, without the executor's internals


@dataclass(frozen=True, slots=True)
class EngineStep:
    now: float
    scheduled: SchedulerOutput
    result: StepResult
    outputs: list[RequestOutput]
    failed: tuple[RequestFailure, ...] = ()  # aborted this step; no output in `outputs`
    admitted: tuple[Admission, ...] = ()  # `scheduled.new_reqs`, with what a server reports


class StepFailed(HybridServeError):
    """The executor raised during a step. The step's requests were aborted and their blocks
    freed; the cause is `__cause__`."""

    def __init__(self, step_id: int, req_ids: tuple[str, ...]) -> None:
        self.step_id = step_id
        self.req_ids = req_ids
        super().__init__(f"step {step_id} failed in the executor; aborted {len(req_ids)} requests")


class Engine:
    def __init__(
        self, scheduler: Scheduler, executor: Executor, *, vocab_size: int | None = None
    ) -> None:
        """`vocab_size`, when given, bounds the token ids an executor may return."""
        self.scheduler = scheduler
        self.executor = executor
        self.vocab_size = vocab_size
        # Finished ids a failed step's plan carried: the executor still holds their state.
        self._unsent_finished: tuple[str, ...] = ()

    def add_request(self, request: Request) -> None:
        """Validate and queue; raises RequestError with nothing queued on bad input."""
        self.scheduler.add_request(request)

    def abort(self, req_id: str) -> None:
        self.scheduler.abort(req_id)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests()

    # ----- read-only queries (what a server needs between steps) ------------------------------

    def has_request(self, req_id: str) -> bool:
        """True while `req_id` is waiting or running (not yet finished or aborted)."""
        return req_id in self.scheduler.requests

    def request_ids(self) -> tuple[str, ...]:
        """The ids of every waiting or running request, in arrival order."""
        return tuple(self.scheduler.requests)

    def unstarted_request_ids(self) -> tuple[str, ...]:
        """The requests not running that produced no token yet (what a drain may drop)."""
        return tuple(
            request.req_id
            for request in self.scheduler.requests.values()
            if request.status is not RequestStatus.RUNNING and not request.num_output_tokens
        )

    def token_ids(self, req_id: str) -> list[int]:
        """The prompt and output tokens of a waiting or running request ([] once it is gone)."""
        request = self.scheduler.requests.get(req_id)
        return request.token_ids if request is not None else []

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def next_pin_deadline(self) -> float | None:
        """When the scheduler's next tool-call pin expires, if one does."""
        return self.scheduler.next_pin_deadline()

    def release_expired_pins(self, now: float) -> int:
        """Between steps (an idle engine): release the pins expired by `now`."""
        return self.scheduler.release_expired_pins(now)

    def control_samples(self) -> list[tuple[str, str, float]]:
        """The scheduler controls' counters and gauges as (Prometheus name, kind, value)."""
        return self.scheduler.controls.stats.samples()

    def step(self, now: float = 0.0) -> EngineStep:
        """One step. Raises StepFailed, with the step's requests aborted, if the executor
        raises; the engine stays consistent and can step again."""
        scheduled = self.scheduler.schedule(now)
        admitted = self._admitted(scheduled) if scheduled.new_reqs else ()
        plan = scheduled.plan
        if self._unsent_finished:
            finished = (*self._unsent_finished, *plan.finished_req_ids)
            plan = replace(plan, finished_req_ids=finished)
        try:
            result = self.executor.execute(plan)
        except Exception as exc:
            raise self._fail_step(plan) from exc
        self._unsent_finished = ()
        result, failed = self._checked(plan, result)
        if scheduled.refused:
            failed = (*(RequestFailure(r, why) for r, why in scheduled.refused), *failed)
        outputs = self.scheduler.update(scheduled, result)
        for failure in failed:
            if failure.req_id in self.scheduler.requests:
                self.scheduler.abort(failure.req_id)
        return EngineStep(now, scheduled, result, outputs, failed, admitted)

    def _admitted(self, scheduled: SchedulerOutput) -> tuple[Admission, ...]:
        admitted = []
        for req_id, num_cached in scheduled.new_reqs:
            request = self.scheduler.requests[req_id]
            admitted.append(
                Admission(req_id, request.arrival_time, request.num_prompt_tokens, num_cached)
            )
        return tuple(admitted)

    def _fail_step(self, plan: StepPlan) -> StepFailed:
        self._unsent_finished = plan.finished_req_ids
        scheduler, cache = self.scheduler, self.scheduler.cache
        in_flight = scheduler.requests
        req_ids = tuple(dict.fromkeys(c.req_id for c in plan.chunks if c.req_id in in_flight))
        held = [b for r in req_ids for group in cache.block_ids(r) for b in group]
        for req_id in req_ids:
            scheduler.abort(req_id)
        cache.uncache_free_blocks(held)
        cache.drop_failed_loads([*held, *(copy.block_id for copy in plan.host_loads)])
        cache.forget_host_slots(copy.slot for copy in plan.host_saves)
        cache.check_invariants()
        return StepFailed(plan.step_id, req_ids)

    def _checked(
        self, plan: StepPlan, result: StepResult
    ) -> tuple[StepResult, tuple[RequestFailure, ...]]:
        """The result without unusable outputs, and the requests they belong to."""
        sampled = result.sampled_token_ids
        vocab = self.vocab_size
        failed: list[RequestFailure] = []
        for chunk in plan.chunks:
            if not chunk.sample:
                continue
            tokens = sampled.get(chunk.req_id)
            if not tokens:
                failed.append(RequestFailure(chunk.req_id, "the executor returned no token"))
            elif vocab is not None and (min(tokens) < 0 or max(tokens) >= vocab):
                bad = next(t for t in tokens if not 0 <= t < vocab)
                reason = f"the executor returned token id {bad}, outside the vocabulary"
                reason += f" [0, {vocab})"
                failed.append(RequestFailure(chunk.req_id, reason))
        if not failed:
            return result, ()
        dropped = {f.req_id for f in failed}
        kept = {r: t for r, t in sampled.items() if r not in dropped}
        drafts = {r: t for r, t in result.draft_token_ids.items() if r not in dropped}
        return replace(result, sampled_token_ids=kept, draft_token_ids=drafts), tuple(failed)
