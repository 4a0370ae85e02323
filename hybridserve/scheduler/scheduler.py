"""Scheduler: vLLM v1's token-budget loop (running first, then waiting), preemption by
recompute, prefix hits at admission, and the finished-id flush one step later.

With every control off the decisions are vLLM 0.33's exactly; `hybridserve replay-vllm` proves
it step by step against recordings of the real scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from hybridserve.core.config import ProgramPriority, SchedulerConfig, SchedulingPolicy
from hybridserve.core.errors import RequestError
from hybridserve.core.plan import ScheduledChunk, StepPlan, StepResult
from hybridserve.core.request import Request, RequestStatus
from hybridserve.kvcache import Allocation, CacheHit, KVCacheManager
from hybridserve.scheduler.align import AlignSplitter
from hybridserve.scheduler.controls import UNLIMITED as UNLIMITED_PLAN
from hybridserve.scheduler.controls import PrefillController, PrefillPlan, is_decode
from hybridserve.scheduler.output import SchedulerOutput
from hybridserve.scheduler.queue import FcfsQueue, PriorityQueue, ProgramQueue
from hybridserve.scheduler.sessions import ToolGapModel
from hybridserve.scheduler.step import StepState
from hybridserve.scheduler.step_model import StepTimeModel

PLACEHOLDER_DRAFT = -1  # a padding draft row: never a real token, never accepted


class RequestOutput(NamedTuple):
    """What one step produced for one request."""

    req_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None


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
        self.waiting: FcfsQueue | PriorityQueue | ProgramQueue = (
            PriorityQueue() if config.policy is SchedulingPolicy.PRIORITY else FcfsQueue()
        )
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
        self.max_pinned_blocks = int(config.kv_pin_fraction * (cache.layout.num_blocks - 1))
        self._now = 0.0
        self._step_end = 0.0
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_pending: list[str] = []
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
        if self.config.policy is SchedulingPolicy.FCFS and request.priority != 0:
            raise RequestError(
                "priority", request.priority, "the fcfs scheduler takes priority 0 only"
            )
        request.block_hashes = self.cache.hasher.hash_tokens(
            request.token_ids, cache_salt=request.cache_salt
        )
        self.requests[request.req_id] = request
        if self.pinning and request.session_id is not None:
            self.tool_gaps.on_arrival(request.session_id, request.arrival_time)
            self.cache.claim_pin(request.session_id)
        self.waiting.add(request)

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
            if self.pinning and request.session_id is not None:
                self.cache.unpin(request.session_id)
        request.transition(RequestStatus.FINISHED_ABORTED)
        del self.requests[req_id]
        self._finished_pending.append(req_id)

    def metrics_snapshot(self) -> dict[str, float]:
        """Scheduler-control counters (SPEC.md 6.3) and queue gauges, by Prometheus name."""
        out: dict[str, float] = {name: value for name, _, value in self.controls.stats.samples()}
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
        return out

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
        plan = self.controls.plan(
            now=now,
            running=self.running,
            waiting=list(self.waiting) if self.controls.enabled else (),
            token_budget=self.token_budget,
            seq_slot_free=len(self.running) < self.config.max_num_seqs,
        )
        step = StepState(self.token_budget, self._threshold(), plan)
        self._schedule_running(step)
        if not step.preempted and plan.allow_prefill:
            self._schedule_waiting(step)
        if plan.grants is not None and step.waiter_tokens:
            self._reclaim(step)
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

    def _schedule_running(self, step: StepState) -> None:
        # The hot loop of every step: locals instead of attribute lookups.
        running = self.running
        limited = step.plan is not UNLIMITED_PLAN
        threshold = step.threshold
        max_position = self.config.max_model_len - 1
        align = self.align_block
        allocate = self.cache.allocate_running
        lookahead = self.num_lookahead_tokens
        scheduled, allocations = step.scheduled, step.allocations
        index = 0
        while index < len(running) and step.budget > 0:
            request = running[index]
            computed = request.num_computed_tokens
            num_new = len(request.token_ids) + len(request.spec_token_ids) - computed
            if limited and not is_decode(request):
                num_new = self._granted(step.plan, request, num_new)
            if 0 < threshold < num_new:
                num_new = threshold
            num_new = min(num_new, step.budget, max_position - computed)
            if align:
                num_new = self.splitter.split(
                    request, num_new, hit=0, junction=request.prefix_junction
                )
            if num_new <= 0:
                index += 1
                continue
            allocation = allocate(
                request.req_id,
                request.block_hashes,
                len(request.token_ids),
                computed,
                num_new,
                lookahead,
            )
            if allocation is None:
                allocation, index = self._allocate_or_preempt(step, request, num_new, index)
                if allocation is None:
                    continue  # it preempted itself; the requests after it may still fit
            scheduled[request.req_id] = num_new
            allocations[request.req_id] = allocation
            step.budget -= num_new
            if computed < request.num_tokens - 1:
                step.running_prefill = True
            index += 1
        step.num_running_scheduled = len(scheduled)

    def _allocate_or_preempt(
        self, step: StepState, request: Request, num_new: int, index: int
    ) -> tuple[Allocation | None, int]:
        while True:
            allocation = self.cache.allocate(
                request.req_id,
                request.block_hashes,
                num_tokens=request.num_tokens,
                num_computed_tokens=request.num_computed_tokens,
                num_new_tokens=num_new,
                num_lookahead_tokens=self.num_lookahead_tokens,
            )
            if allocation is not None:
                return allocation, index
            if self.pinning and self.cache.release_pin_for_room():
                continue  # memory pressure: a pin goes before a running request is preempted
            victim = self._pick_victim()
            victim_index = self.running.index(victim)
            self.running.pop(victim_index)
            if victim_index < index:
                index -= 1
            step.unschedule(victim.req_id)
            self._preempt(victim, step)
            if victim is request:
                return None, index

    def _pick_victim(self) -> Request:
        if self.config.policy is SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, step: StepState) -> None:
        self.cache.free(request.req_id)
        request.transition(RequestStatus.PREEMPTED)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.spec_token_ids.clear()
        self.waiting.prepend(request)
        step.preempted.append(request.req_id)

    def _schedule_waiting(self, step: StepState) -> None:
        config = self.config
        while self.waiting and step.budget > 0:
            if len(self.running) >= config.max_num_seqs:
                break
            request = self.waiting.peek()
            resumed = request.status is RequestStatus.PREEMPTED
            hit = self.cache.find_hit(request.block_hashes, request.num_tokens, resumed=resumed)
            num_new = request.num_tokens - hit.num_tokens
            if 0 < step.threshold < num_new:
                num_new = step.threshold
            if not config.enable_chunked_prefill and num_new > step.budget:
                break
            num_new = min(num_new, step.budget)
            if step.waiter_tokens is not None:
                num_new = min(num_new, step.waiter_tokens)
                if num_new <= 0:
                    break
            if self.align_block:
                num_new = self.splitter.split(
                    request, num_new, hit=hit.num_tokens, junction=hit.junction
                )
                if num_new <= 0:
                    break
            if (
                self.num_lookahead_tokens
                and num_new == 1
                and request.num_tokens - hit.num_tokens == 1
                and not step.running_prefill
                and (step.num_running_scheduled or hit.num_tokens > 0)
            ):
                # vLLM pads a one-token admission (a full hit, a resumed request) to the
                # 1 + K rows of a decode with K placeholder drafts, or stops admitting.
                if step.budget < 1 + self.num_lookahead_tokens:
                    break
                request.spec_token_ids[:] = [PLACEHOLDER_DRAFT] * self.num_lookahead_tokens
                num_new = 1 + self.num_lookahead_tokens
            completes = hit.num_tokens + num_new >= request.num_tokens
            if self.controls.max_partials and not self.controls.admits(
                partials_after=self._partials_after(step), completes=completes
            ):
                break
            if self.config.kv_aware_admission and not self._fits_without_preemption(
                request, hit, num_new
            ):
                break
            allocation = self._admit(request, hit, num_new)
            if allocation is None:
                break  # head-of-line blocking
            (step.resumed if resumed else step.new_reqs).append((request.req_id, hit.num_tokens))
            step.record(request.req_id, num_new, allocation, new_request=True)
            if step.waiter_tokens is not None:
                step.waiter_tokens -= num_new
            if not completes:
                step.new_partials += 1

    def _admit(self, request: Request, hit: CacheHit, num_new: int) -> Allocation | None:
        while True:
            allocation = self.cache.allocate(
                request.req_id,
                request.block_hashes,
                num_tokens=request.num_tokens,
                num_computed_tokens=0,
                num_new_tokens=num_new,
                num_lookahead_tokens=self.num_lookahead_tokens,
                hit=hit,
                num_prompt_tokens=request.num_tokens,  # a resumed request replays its outputs
                full_sequence_must_fit=self.config.reserve_full_isl,
            )
            if allocation is not None:
                break
            if not hit.ready:
                return None
            # Pins never stall admission: release other sessions' pins, soonest TTL first.
            # Releasing frees blocks without evicting any, so `hit` stays valid.
            if not (self.pinning and self.cache.release_pin_for_room(keep=request.session_id)):
                return None
        if self.pinning and request.session_id is not None:
            self.cache.unpin(request.session_id)  # back, holding its hit: the pin is done
        self.waiting.pop()
        self.running.append(request)
        request.transition(RequestStatus.RUNNING)
        request.num_computed_tokens = hit.num_tokens
        request.prefix_junction = hit.junction
        return allocation

    def _fits_without_preemption(self, request: Request, hit: CacheHit, num_new: int) -> bool:
        """KV-aware admission: admit only if, after this request's blocks, the free pool still
        covers the growth of every running request (and this one) over its remaining output,
        up to the horizon; otherwise admitting it would later force preemptions. Always true
        with nothing running (a lone request can always start)."""
        if not self.running:
            return True
        horizon = self.config.kv_admission_horizon_tokens
        cache = self.cache
        reserve = 0
        for running in self.running:
            room = running.sampling.max_tokens - running.num_output_tokens
            reserve += cache.growth_blocks(running.num_tokens, min(room, horizon))
        own = request.num_tokens - hit.num_tokens
        need = cache.growth_blocks(hit.num_tokens, own + min(request.sampling.max_tokens, horizon))
        return cache.num_free_blocks >= need + reserve

    def _granted(self, plan: PrefillPlan, request: Request, num_new: int) -> int:
        """A running partial prefill's tokens under the step's prefill plan."""
        if not plan.allow_prefill:
            return 0
        if plan.grants is None:
            return num_new
        return min(num_new, plan.grants.get(request.req_id, 0))

    def _partials_after(self, step: StepState) -> int:
        """Running requests still short of their prompt end once this step's tokens land."""
        count = step.new_partials
        for request in self.running:
            if step.admitted and request.req_id in step.admitted:
                continue
            done = request.num_computed_tokens + step.scheduled.get(request.req_id, 0)
            if done < max(request.num_prompt_tokens, request.num_tokens - 1):
                count += 1
        return count

    def _reclaim(self, step: StepState) -> None:
        """Give quanta the head waiter could not use back to the running partial prefills."""
        left = step.waiter_tokens or 0
        for request in self.running:
            if left <= 0 or step.budget <= 0:
                break
            if request.req_id in step.admitted or is_decode(request):
                continue
            already = step.scheduled.get(request.req_id, 0)
            remaining = request.num_tokens - request.num_computed_tokens
            total = min(already + left, remaining, already + step.budget)
            if self.align_block:
                total = self.splitter.split(request, total, hit=0, junction=request.prefix_junction)
            extra = total - already
            if extra <= 0:
                continue
            allocation = self.cache.allocate(
                request.req_id,
                request.block_hashes,
                num_tokens=request.num_tokens,
                num_computed_tokens=request.num_computed_tokens + already,
                num_new_tokens=extra,
                num_lookahead_tokens=self.num_lookahead_tokens,
            )
            if allocation is None:
                break
            step.extend(request.req_id, extra, allocation)
            left -= extra
        step.waiter_tokens = left

    def _finish_schedule(self, step: StepState) -> SchedulerOutput:
        chunks = []
        num_prefill = num_decode = kv_read = 0
        requests, admitted, allocations = self.requests, step.admitted, step.allocations
        for req_id, num_new in step.scheduled.items():
            request = requests[req_id]
            start = request.num_computed_tokens
            end = start + num_new
            request.num_computed_tokens = end
            token_ids = request.token_ids
            num_tokens = len(token_ids)
            kv_read += end
            if end <= num_tokens:
                num_draft = 0
                tokens = (token_ids[start],) if num_new == 1 else tuple(token_ids[start:end])
            else:
                num_draft = end - num_tokens
                tokens = (*token_ids[start:], *request.spec_token_ids[:num_draft])
            if request.spec_token_ids:
                request.spec_token_ids.clear()  # every scheduled request uses up its drafts
            prompt_end = request.num_prompt_tokens
            if start < (prompt_end if prompt_end > num_tokens - 1 else num_tokens - 1):
                num_prefill += num_new
            else:
                num_decode += num_new
            if req_id in admitted:
                chunks.append(
                    ScheduledChunk(
                        req_id,
                        start,
                        tokens,
                        self.cache.block_ids(req_id),
                        end - num_draft >= num_tokens,
                        num_draft,
                        True,
                        request.sampling,
                    )
                )
            else:
                chunks.append(
                    ScheduledChunk(
                        req_id,
                        start,
                        tokens,
                        allocations[req_id].new_block_ids,
                        end - num_draft >= num_tokens,
                        num_draft,
                    )
                )
        if self.controls.enabled:
            partials = sum(1 for r in self.running if not is_decode(r))
            self.controls.observe(step.plan, prefill_tokens=num_prefill, partials_after=partials)
        finished = tuple(self._finished_pending)
        self._finished_pending = []
        plan = StepPlan(
            step_id=self.step_id,
            chunks=tuple(chunks),
            block_copies=tuple(c for a in step.allocations.values() for c in a.block_copies),
            preempted_req_ids=tuple(step.preempted),
            finished_req_ids=finished,
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
            num_decode_tokens=num_decode,
            kv_tokens_read=kv_read,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.cache.usage(),
            mixed_budget=step.plan.mixed_budget,
            decode_only=not step.plan.allow_prefill,
            deadline_bypass=step.plan.bypass,
        )

    # ----- update -------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """Append sampled tokens, reject unverified drafts, finish requests, free their blocks."""
        self.controls.learn(
            decode=output.num_decode_tokens,
            prefill=output.num_prefill_tokens,
            kv_tokens_read=output.kv_tokens_read,
            duration_s=result.duration_s,
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
                request.spec_token_ids.clear()
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
                reason = request.finish_reason.value if request.finish_reason else None
                outputs.append(RequestOutput(request.req_id, new_tokens, True, reason))
            else:
                outputs.append(RequestOutput(request.req_id, new_tokens, False, None))
        if any_finished:
            self.running = [r for r in self.running if r.status is running_status]
        if result.draft_token_ids:
            self._keep_drafts(output, result.draft_token_ids)
        return outputs

    def _pin_for_return(self, request: Request) -> None:
        """Tool-call pinning: hold the finished turn's prefix for its session's next turn."""
        session = request.session_id
        assert session is not None
        self.tool_gaps.on_finish(session, self._step_end)
        self.cache.pin(
            session,
            request.block_hashes,
            request.num_computed_tokens,
            deadline=self._step_end + self.tool_gaps.ttl(session),
            max_pinned_blocks=self.max_pinned_blocks,
        )

    def _keep_drafts(self, output: SchedulerOutput, drafts: Mapping[str, tuple[int, ...]]) -> None:
        """Store the drafts for the next step of requests that sampled this step and still run
        (vLLM's `update_draft_token_ids`: a request in a partial prefill chunk drops them)."""
        requests, limit = self.requests, self.num_lookahead_tokens
        for chunk in output.plan.chunks:
            proposed = drafts.get(chunk.req_id)
            if not proposed or not chunk.sample:
                continue
            request = requests.get(chunk.req_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                request.spec_token_ids[:] = proposed[:limit]

    def _append(self, request: Request, sampled: tuple[int, ...]) -> tuple[int, ...]:
        sampling = request.sampling
        stop_ids = () if sampling.ignore_eos else sampling.stop_token_ids
        room = sampling.max_tokens - len(request.output_token_ids)
        status = None
        if len(sampled) == 1 and not stop_ids and room > 1:
            kept: tuple[int, ...] | list[int] = sampled  # the common decode: nothing to check
        else:
            kept = []
            for token in sampled:
                kept.append(token)
                if token in stop_ids:
                    status = RequestStatus.FINISHED_STOPPED
                    break
                if len(kept) >= room:
                    status = RequestStatus.FINISHED_LENGTH
                    break
        request.append_output_tokens(kept)
        if len(kept) < len(sampled):
            # Tokens past a stop are not kept: their positions were not verified either.
            request.num_computed_tokens -= len(sampled) - len(kept)
        hashes, token_ids = request.block_hashes, request.token_ids
        if (len(token_ids) - self.hash_lookahead) // self.hash_block_size > len(hashes):
            self.cache.hasher.extend(hashes, token_ids, cache_salt=request.cache_salt)
        if status is not None:
            request.transition(status)
            if self.num_lookahead_tokens:
                # Under speculation vLLM registers the verified blocks of a finishing request
                # before freeing them: accepted drafts complete blocks no schedule has seen
                # (without drafts every such block was registered when it was scheduled).
                self.cache.cache_computed(
                    request.req_id, hashes, request.num_computed_tokens, len(token_ids)
                )
            if self.pinning and request.session_id is not None:
                self._pin_for_return(request)
            self.cache.free(request.req_id)
            del self.requests[request.req_id]
            self._finished_pending.append(request.req_id)
        return tuple(kept)
