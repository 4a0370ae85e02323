"""Scheduler: vLLM v1's token-budget loop (running first, then waiting), preemption by
recompute, prefix hits at admission, and the finished-id flush one step later.

With every control off the decisions are vLLM 0.33's exactly; `hybridserve replay-vllm` proves
it step by step against recordings of the real scheduler.

This module owns the requests and the order of a step; its halves are their own modules:
`running` (running requests, preemption), `admission` (waiting requests), `chunks` (the step
plan's chunks) and `sampled` (update()'s stop and draft rules). The prefill/decode controls are
one object, `controls`, which the loop asks at fixed points.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

from hybridserve.core.config import ProgramPriority, SchedulerConfig, SchedulingPolicy
from hybridserve.core.errors import RequestError
from hybridserve.core.plan import StepPlan, StepResult
from hybridserve.core.request import FinishReason, Request, RequestStatus
from hybridserve.kvcache import KVCacheManager
from hybridserve.scheduler.admission import schedule_waiting
from hybridserve.scheduler.align import AlignSplitter
from hybridserve.scheduler.chunks import cut_chunks
from hybridserve.scheduler.controls import PrefillController, count_partials
from hybridserve.scheduler.output import SchedulerOutput
from hybridserve.scheduler.queue import (
    DeadlineQueue,
    FcfsQueue,
    PriorityQueue,
    ProgramQueue,
    WaitingQueue,
)
from hybridserve.scheduler.running import schedule_running, take_more
from hybridserve.scheduler.sampled import keep_drafts, keep_sampled
from hybridserve.scheduler.sessions import ToolGapModel
from hybridserve.scheduler.step import StepState
from hybridserve.scheduler.step_model import StepTimeModel


class RequestOutput(NamedTuple):
    """What one step produced for one request."""

    req_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None  # set when `finished`


class Scheduler:
    """Owns the requests and their lifecycle. Only the scheduler mutates a Request."""

    def __init__(
        self,
        config: SchedulerConfig,
        cache: KVCacheManager,
        *,
        num_speculative_tokens: int = 0,
        step_model: StepTimeModel | None = None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.num_lookahead_tokens = num_speculative_tokens
        self.waiting: WaitingQueue = (
            PriorityQueue() if config.policy is SchedulingPolicy.PRIORITY else FcfsQueue()
        )
        self.deadline_queue: DeadlineQueue | None = None
        if config.waiting_deadline_ms > 0:
            self.deadline_queue = DeadlineQueue(config.waiting_deadline_ms / 1000.0)
            self.waiting = self.deadline_queue
        # Agent-aware controls (all off by default: vLLM's schedule).
        self.program_queue: ProgramQueue | None = None
        if config.program_priority is not ProgramPriority.OFF:
            self.program_queue = ProgramQueue(
                config.program_priority, config.program_priority_max_wait_s
            )
            self.waiting = self.program_queue
        self.pinning = config.pins_kv and cache.enable_caching
        self.tool_gaps = ToolGapModel(
            quantile=config.kv_pin_ttl_quantile, cap_s=config.kv_pin_max_ttl_s
        )
        self.max_pinned_blocks = int(config.kv_pin_fraction * cache.usable_blocks)
        self.exact_tails = self.pinning and config.kv_pin_exact_tail
        self._now = 0.0
        self._step_end = 0.0
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_pending: list[str] = []
        self._refused: list[tuple[str, str]] = []  # this step's, emitted in its output
        self.step_id = 0
        self.token_budget = config.max_num_batched_tokens
        self.hash_block_size = cache.layout.hash_block_size
        self.hash_lookahead = cache.hasher.lookahead
        self.splitter = AlignSplitter(config, cache)
        self.align_block = self.splitter.block
        # The quantum q: prefill grants are multiples of the state block (1 without one).
        self.controls = PrefillController(
            config, quantum=self.align_block or 1, step_model=step_model
        )
        # What the settings asked for that this layout cannot do, said once by the front end.
        self.notices: list[str] = self._turn_off_what_cannot_apply()

    def _turn_off_what_cannot_apply(self) -> list[str]:
        """A preset serves every layout: a control that cannot apply turns itself off, and
        says why (the notices)."""
        notices = []
        obstacle = self.cache.exact_tail_obstacle() if self.exact_tails else None
        if obstacle is not None:
            self.exact_tails = False
            notices.append(f"kv_pin_exact_tail is off for this model ({obstacle}); pins stay on")
        if self.config.adaptive_budget_context_weight and self.controls.context is None:
            notices.append(
                "adaptive_budget_context_weight is off: a mixed-prefill cap or "
                "target_mixed_step_ms shares the prefill budget out"
            )
        return notices

    # ----- requests -----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises RequestError (and queues nothing) if it cannot run."""
        if request.req_id in self.requests:
            raise RequestError("req_id", request.req_id, "use an id that is not in flight")
        if request.status is not RequestStatus.WAITING or request.num_output_tokens:
            raise RequestError("status", request.status.value, "add a fresh request")
        limit = self.config.max_model_len
        if request.num_prompt_tokens >= limit:
            raise RequestError(
                "prompt_token_ids",
                f"<{request.num_prompt_tokens} tokens>",
                f"max_model_len={limit} leaves no room to generate; shorten the prompt",
            )
        self.config.check_priority(request.priority)
        request.block_hashes = self.cache.hasher.hash_tokens(
            request.token_ids, cache_salt=request.cache_salt
        )
        self.requests[request.req_id] = request
        if self.pinning and request.session_key is not None:
            self.tool_gaps.on_arrival(request.session_key, request.arrival_time)
            self.cache.claim_pin(request.session_key)
        self.waiting.add(request)

    def refuse(self, request: Request, why: str) -> None:
        """Abort a waiter that can never start (nothing else holds a block and its blocks still
        do not fit): it is reported in this step's output with `why`, and the waiters behind
        it go on. A preempted one the executor knows is finished there as any abort is."""
        self.abort(request.req_id)
        self._refused.append((request.req_id, why))

    def _take_refused(self) -> tuple[tuple[str, str], ...]:
        refused, self._refused = tuple(self._refused), []
        return refused

    def abort(self, req_id: str) -> None:
        """Abort a waiting or running request and free its blocks."""
        request = self.requests.get(req_id)
        if request is None:
            raise RequestError("req_id", req_id, "no such request is in flight")
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.cache.free(req_id)
        else:
            self.waiting.remove(request)
            self.cache.free(req_id)  # what a prefetch holds for it
            if self.pinning and request.session_key is not None:
                self.cache.unpin(request.session_key)
        request.transition(RequestStatus.FINISHED_ABORTED)
        del self.requests[req_id]
        self._finished_pending.append(req_id)

    def metrics_snapshot(self) -> dict[str, float]:
        """Scheduler-control counters (SPEC.md 6.3) and queue gauges, by Prometheus name."""
        out: dict[str, float] = {name: value for name, _, value in self.controls.stats.samples()}
        if self.controls.adaptive is not None:
            out["hybridserve:scheduler_adaptive_prefill_budget_tokens"] = (
                self.controls.adaptive.tokens()
            )
        if self.deadline_queue is not None:
            out["hybridserve:scheduler_requests_past_deadline_total"] = (
                self.deadline_queue.num_demoted
            )
        out["hybridserve:num_requests_running"] = len(self.running)
        out["hybridserve:num_requests_waiting"] = len(self.waiting)
        out["hybridserve:kv_cache_usage_perc"] = self.cache.usage()
        if self.pinning:
            stats = self.cache.pin_stats
            out["hybridserve:kv_pinned_blocks"] = self.cache.num_pinned_blocks
            out["hybridserve:kv_pins_total"] = stats.pinned
            out["hybridserve:kv_pins_refused_total"] = stats.refused
            out["hybridserve:kv_pins_released_on_return_total"] = stats.released_on_return
            out["hybridserve:kv_pins_released_on_ttl_total"] = stats.released_on_ttl
            out["hybridserve:kv_pins_released_on_pressure_total"] = stats.released_on_pressure
            if self.exact_tails:
                out["hybridserve:kv_pin_tails_total"] = stats.tails
                out["hybridserve:kv_pin_tail_hits_total"] = stats.tail_hits
                if self.cache.host is not None:
                    out["hybridserve:kv_pin_tails_to_host_total"] = stats.tails_to_host
                    out["hybridserve:kv_pin_host_tail_hits_total"] = stats.host_tail_hits
        return out

    def next_pin_deadline(self) -> float | None:
        """When the next tool-call pin expires (None: pinning off, or no pin expires)."""
        return self.cache.next_pin_deadline() if self.pinning else None

    def release_expired_pins(self, now: float) -> int:
        """Release the pins whose TTL ran out by `now` without a step (an idle engine), as
        `schedule` does first thing. Returns how many."""
        return self.cache.expire_pins(now) if self.pinning else 0

    def has_requests(self) -> bool:
        """True while any request is unfinished or finished ids are not yet reported."""
        return bool(self.running or self.waiting or self._finished_pending)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ----- schedule -----------------------------------------------------------------------

    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        """Running requests first (decodes and partial prefills, in order), then waiting ones.

        `now` is the step's time; the baseline does not use it (the controls do).
        """
        self.cache.new_step()
        self._now = now
        if self.pinning:
            self.cache.expire_pins(now)
        if self.program_queue is not None:
            self.program_queue.now = now
        if self.deadline_queue is not None:
            self.deadline_queue.advance(now)
        decision = self.controls.decide_and_commit(
            now=now,
            running=self.running,
            waiting=list(self.waiting) if self.controls.enabled else (),
            token_budget=self.token_budget,
            seq_slot_free=len(self.running) < self.config.max_num_seqs,
        )
        step = StepState(self.token_budget, self._threshold(), decision)
        schedule_running(self, step)
        if not step.preempted and decision.allow_prefill:
            schedule_waiting(self, step)
        step.prefill.reclaim(self.running, step, partial(take_more, self, step))
        if self.program_queue is not None:
            for req_id, num_new in step.scheduled.items():
                self.program_queue.add_service(self.requests[req_id], num_new)
        return self._finish_schedule(step)

    def _threshold(self) -> int:
        # vLLM caps long prefills only when more than one request is in flight.
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0 and len(self.running) + len(self.waiting) > 1:
            return threshold
        return 0

    def _finish_schedule(self, step: StepState) -> SchedulerOutput:
        tally = cut_chunks(step, self.requests, self.cache)
        num_prefill = tally.num_prefill_tokens
        if self.controls.enabled:
            self.controls.observe(
                step.decision,
                prefill_tokens=num_prefill,
                partials_after=count_partials(self.running),
            )
        finished = tuple(self._finished_pending)
        self._finished_pending = []
        host_saves, host_loads = self.cache.take_host_transfers()
        plan = StepPlan(
            step_id=self.step_id,
            chunks=tally.chunks,
            block_copies=tuple(c for a in step.allocations.values() for c in a.block_copies),
            preempted_req_ids=tuple(step.preempted),
            finished_req_ids=finished,
            host_saves=host_saves,
            host_loads=host_loads,
        )
        self.step_id += 1
        return SchedulerOutput(
            plan=plan,
            num_scheduled_tokens=tuple(step.scheduled.items()),
            new_reqs=tuple(step.new_reqs),
            resumed=tuple(step.resumed),
            preempted=tuple(step.preempted),
            finished_req_ids=finished,
            num_free_blocks=self.cache.num_free_blocks,
            num_prefill_tokens=num_prefill,
            num_decode_tokens=tally.num_decode_tokens,
            kv_tokens_read=tally.kv_tokens_read,
            decode_kv_tokens=tally.decode_kv_tokens,
            prefill_pairs=tally.prefill_pairs,
            max_prefill_start=tally.max_prefill_start,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.cache.usage(),
            mixed_budget=step.decision.mixed_budget,
            decode_only=not step.decision.allow_prefill,
            deadline_bypass=step.decision.bypass,
            refused=self._take_refused(),
        )

    # ----- update -------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """Append sampled tokens, reject unverified drafts, finish requests, free their blocks."""
        self.controls.learn(
            decode=output.num_decode_tokens,
            prefill=output.num_prefill_tokens,
            kv_tokens_read=output.kv_tokens_read,
            duration_s=result.duration_s,
            shape=output,
        )
        self._step_end = self._now + result.duration_s
        outputs: list[RequestOutput] = []
        any_finished = False
        requests, sampled_ids = self.requests, result.sampled_token_ids
        running_status = RequestStatus.RUNNING
        for chunk in output.plan.chunks:
            if not chunk.sample:
                continue  # a partial prefill chunk samples nothing
            request = requests.get(chunk.req_id)
            if request is None or request.status is not running_status:
                continue  # aborted or preempted since
            sampled = sampled_ids.get(chunk.req_id, ())
            if chunk.num_draft_tokens:
                accepted = max(len(sampled) - 1, 0)
                request.num_computed_tokens -= chunk.num_draft_tokens - accepted
                request.draft_token_ids.clear()
            if not sampled:
                continue
            sampling = request.sampling
            if (
                len(sampled) == 1
                and (sampling.ignore_eos or not sampling.stop_token_ids)
                and sampling.max_tokens - len(request.output_token_ids) > 1
            ):
                # The common decode: one token, no stop condition can trigger.
                request.output_token_ids.append(sampled[0])
                token_ids = request.token_ids
                token_ids.append(sampled[0])
                if (len(token_ids) - self.hash_lookahead) // self.hash_block_size > len(
                    request.block_hashes
                ):
                    self.cache.hasher.extend(
                        request.block_hashes, token_ids, cache_salt=request.cache_salt
                    )
                outputs.append(RequestOutput(request.req_id, sampled, False, None))
                continue
            new_tokens = self._append(request, sampled)
            if request.status is not running_status:
                any_finished = True
                reason = request.finish_reason
                outputs.append(RequestOutput(request.req_id, new_tokens, True, reason))
            else:
                outputs.append(RequestOutput(request.req_id, new_tokens, False, None))
        if any_finished:
            self.running = [r for r in self.running if r.status is running_status]
        if result.draft_token_ids:
            keep_drafts(
                output.plan.chunks, requests, result.draft_token_ids, self.num_lookahead_tokens
            )
        return outputs

    def _pin_for_return(self, request: Request) -> None:
        """Tool-call pinning: hold the finished turn's prefix for its session's next turn."""
        session = request.session_key
        assert session is not None
        self.tool_gaps.on_finish(session, self._step_end)
        self.cache.pin(
            session,
            request.block_hashes,
            request.num_computed_tokens,
            deadline=self._step_end + self.tool_gaps.ttl(session),
            max_pinned_blocks=self.max_pinned_blocks,
            req_id=request.req_id if self.exact_tails else None,
            token_ids=request.token_ids if self.exact_tails else (),
        )

    def _append(self, request: Request, sampled: tuple[int, ...]) -> tuple[int, ...]:
        """Append the sampled tokens the request keeps; finish it on a stop or its length."""
        kept, status = keep_sampled(request.sampling, len(request.output_token_ids), sampled)
        request.append_output_tokens(kept)
        if len(kept) < len(sampled):
            # Tokens past a stop are not kept: their positions were not verified either.
            request.num_computed_tokens -= len(sampled) - len(kept)
        hashes, token_ids = request.block_hashes, request.token_ids
        if (len(token_ids) - self.hash_lookahead) // self.hash_block_size > len(hashes):
            self.cache.hasher.extend(hashes, token_ids, cache_salt=request.cache_salt)
        if status is not None:
            request.transition(status)
            self._retire(request)
        return tuple(kept)

    def _retire(self, request: Request) -> None:
        """A request that just finished: register its verified blocks under speculation, pin
        its prefix for its session, free its blocks and report its id with the next step."""
        if self.num_lookahead_tokens:
            # Under speculation vLLM registers the verified blocks of a finishing request
            # before freeing them: accepted drafts complete blocks no schedule has seen
            # (without drafts every such block was registered when it was scheduled).
            self.cache.cache_computed(
                request.req_id,
                request.block_hashes,
                request.num_computed_tokens,
                len(request.token_ids),
            )
        if self.pinning and request.session_key is not None:
            self._pin_for_return(request)
        self.cache.free(request.req_id)
        del self.requests[request.req_id]
        self._finished_pending.append(request.req_id)
