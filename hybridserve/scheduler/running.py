"""The running half of a step: every running request in order (decodes and partial prefills),
preemption by recompute when blocks run out, and the reclaim's extra tokens for a partial.

Functions of the scheduler's state; `Scheduler.schedule` calls them in order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridserve.core.config import SchedulingPolicy
from hybridserve.core.request import Request, RequestStatus
from hybridserve.kvcache import Allocation
from hybridserve.scheduler.controls import is_decode
from hybridserve.scheduler.step import StepState

if TYPE_CHECKING:
    from hybridserve.scheduler.scheduler import Scheduler


def schedule_running(scheduler: Scheduler, step: StepState) -> None:
    """Schedule the running requests in order while budget lasts, each its remaining tokens (a
    partial prefill within its grant, the long-prefill threshold, the context limit, the state
    grid); a request that does not fit preempts the lowest-ranked running one, possibly itself."""
    # The hot loop of every step: locals instead of attribute lookups.
    running = scheduler.running
    decision = step.decision
    limited = not decision.unlimited
    threshold = step.threshold
    max_position = scheduler.config.max_model_len - 1
    align = scheduler.align_block
    allocate = scheduler.cache.allocate_running
    lookahead = scheduler.num_lookahead_tokens
    scheduled, allocations = step.scheduled, step.allocations
    index = 0
    while index < len(running) and step.budget > 0:
        request = running[index]
        computed = request.num_computed_tokens
        num_new = len(request.token_ids) + len(request.draft_token_ids) - computed
        if limited and not is_decode(request):
            num_new = decision.grant(request.req_id, num_new)
        if 0 < threshold < num_new:
            num_new = threshold
        num_new = min(num_new, step.budget, max_position - computed)
        if align:
            num_new = scheduler.splitter.split(
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
            allocation, index = allocate_or_preempt(scheduler, step, request, num_new, index)
            if allocation is None:
                continue  # it preempted itself; the requests after it may still fit
        scheduled[request.req_id] = num_new
        allocations[request.req_id] = allocation
        step.budget -= num_new
        if computed < request.num_tokens - 1:
            step.running_prefill = True  # vLLM's test: not its prefill end (see admission)
        index += 1
    step.num_running_scheduled = len(scheduled)


def allocate_or_preempt(
    scheduler: Scheduler, step: StepState, request: Request, num_new: int, index: int
) -> tuple[Allocation | None, int]:
    """Allocate `num_new` tokens for the running request at `index`, releasing pins and then
    preempting victims until they fit. (None, index) when the request preempted itself; the
    index moves down by one for each victim before it."""
    cache = scheduler.cache
    while True:
        allocation = cache.allocate(
            request.req_id,
            request.block_hashes,
            num_tokens=request.num_tokens,
            num_computed_tokens=request.num_computed_tokens,
            num_new_tokens=num_new,
            num_lookahead_tokens=scheduler.num_lookahead_tokens,
        )
        if allocation is not None:
            return allocation, index
        if scheduler.pinning and cache.release_pin_for_room():
            continue  # memory pressure: a pin goes before a running request is preempted
        if cache.release_prefetches():
            continue  # and so does a waiter's prefetch
        victim = pick_victim(scheduler)
        victim_index = scheduler.running.index(victim)
        scheduler.running.pop(victim_index)
        if victim_index < index:
            index -= 1
        step.unschedule(victim.req_id)
        preempt(scheduler, victim, step)
        if victim is request:
            return None, index


def pick_victim(scheduler: Scheduler) -> Request:
    """vLLM's victim: the lowest priority (latest arrival) under the priority policy, else the
    last running request."""
    if scheduler.config.policy is SchedulingPolicy.PRIORITY:
        return max(scheduler.running, key=lambda r: (r.priority, r.arrival_time))
    return scheduler.running[-1]


def preempt(scheduler: Scheduler, request: Request, step: StepState) -> None:
    """Free the request's blocks and put it back at the head of the waiting queue, to recompute
    from token 0."""
    scheduler.cache.free(request.req_id)
    request.transition(RequestStatus.PREEMPTED)
    request.num_computed_tokens = 0
    request.num_preemptions += 1
    request.draft_token_ids.clear()
    scheduler.waiting.prepend(request)
    step.preempted.append(request.req_id)


def take_more(
    scheduler: Scheduler, step: StepState, request: Request, already: int, total: int
) -> int | None:
    """Raise a running partial prefill from `already` to `total` tokens in this step (aligned to
    the state grid): the extra tokens taken (0: none), or None when their blocks do not fit."""
    if scheduler.align_block:
        total = scheduler.splitter.split(request, total, hit=0, junction=request.prefix_junction)
    extra = total - already
    if extra <= 0:
        return 0
    allocation = scheduler.cache.allocate(
        request.req_id,
        request.block_hashes,
        num_tokens=request.num_tokens,
        num_computed_tokens=request.num_computed_tokens + already,
        num_new_tokens=extra,
        num_lookahead_tokens=scheduler.num_lookahead_tokens,
    )
    if allocation is None:
        return None
    step.extend(request.req_id, extra, allocation)
    return extra
