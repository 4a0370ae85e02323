"""The waiting half of a step: admissions from the head of the waiting queue, each with its
prefix hit, until the budget, a sequence slot, a control or the blocks run out (head-of-line
blocking: the first waiter that cannot start stops the admissions).

Functions of the scheduler's state; `Scheduler.schedule` calls them after the running half.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridserve.core.request import Request, RequestStatus
from hybridserve.kvcache import Allocation, CacheHit
from hybridserve.scheduler.step import StepState

if TYPE_CHECKING:
    from hybridserve.scheduler.scheduler import Scheduler

PLACEHOLDER_DRAFT = -1  # a padding draft row: never a real token, never accepted


def schedule_waiting(scheduler: Scheduler, step: StepState) -> None:
    """Admit waiters in queue order while budget and sequence slots last: each takes its
    uncached tokens within the long-prefill threshold, the budget, the decision's waiter tokens and
    the state grid, if the controls and (with KV-aware admission) the pool let it start."""
    config, waiting, prefill = scheduler.config, scheduler.waiting, step.prefill
    # Only the head waiter prefetches: one that lost the head (a preempted request went
    # ahead of it) lets its blocks go.
    scheduler.cache.release_prefetches(keep=waiting.peek().req_id if waiting else None)
    while waiting and step.budget > 0:
        if len(scheduler.running) >= config.max_num_seqs:
            break
        request = waiting.peek()
        resumed = request.status is RequestStatus.PREEMPTED
        hit = _find_hit(scheduler, request, resumed)
        if scheduler.cache.needs_host(hit):
            if _prefetch(scheduler, request, hit, resumed):
                break  # its blocks load beside the next steps; it waits at the head for them
            hit = scheduler.cache.find_hit(
                request.block_hashes, request.num_tokens, resumed=resumed, device_only=True
            )
        # Tokens received from another engine start computed (vLLM's KV connector): the step
        # schedules only what follows them.
        start = max(hit.num_tokens, request.num_external_computed_tokens)
        num_new = request.num_tokens - start
        if 0 < step.threshold < num_new:
            num_new = step.threshold
        if not config.enable_chunked_prefill and num_new > step.budget:
            break
        num_new = prefill.admission_tokens(min(num_new, step.budget), start)
        if num_new <= 0:
            break
        if scheduler.align_block:
            num_new = scheduler.splitter.split(
                request, num_new, hit=start, junction=_junction(hit, start)
            )
            if num_new <= 0:
                break
        num_new = pad_for_drafts(scheduler, step, request, start, num_new)
        if num_new <= 0:
            break
        completes = start + num_new >= request.num_tokens
        if not prefill.admits(completes=completes, running=scheduler.running, step=step):
            break
        if config.kv_aware_admission and not fits_without_preemption(
            scheduler, request, hit, num_new
        ):
            break
        allocation = admit(scheduler, request, hit, num_new, start=start)
        if allocation is None:
            if hit.ready and _own_pin_in_the_way(scheduler):
                continue  # its session's pin is gone: look again
            if hit.ready and _can_never_start(scheduler):
                scheduler.refuse(request, _too_long_for_the_pool(scheduler, request))
                continue
            break  # head-of-line blocking
        (step.resumed if resumed else step.new_reqs).append((request.req_id, hit.num_tokens))
        step.record(request.req_id, num_new, allocation, new_request=True)
        prefill.charge(num_new, completes=completes)


def _can_never_start(scheduler: Scheduler) -> bool:
    """The head waiter's blocks did not fit a pool that nothing else holds a block of (no
    request running, no pin, no prefetch): they never will. vLLM refuses at start-up a pool
    that cannot hold max_model_len, so there it cannot happen; a pool here may be smaller, and
    the waiter would hold the head of the queue, and every waiter behind it, for good."""
    cache = scheduler.cache
    return not scheduler.running and cache.num_free_blocks >= cache.usable_blocks


def _own_pin_in_the_way(scheduler: Scheduler) -> bool:
    """The head waiter did not fit and nothing runs that could free a block: the one pin left
    is its own session's (`admit` released the others), holding blocks its hit does not use.
    Release it (as for room: an exact end goes to the host tier where there is one) and the
    waiter looks again; without this it would wait for itself for good."""
    return not scheduler.running and scheduler.pinning and scheduler.cache.release_pin_for_room()


def _too_long_for_the_pool(scheduler: Scheduler, request: Request) -> str:
    usable = scheduler.cache.usable_blocks
    return (
        f"prompt_token_ids=<{request.num_tokens} tokens> cannot start: its blocks do not fit "
        f"the whole KV pool ({usable} blocks, none of them in use); shorten the prompt, or give "
        "the pool more blocks (e.g. --num-blocks)"
    )


def _find_hit(scheduler: Scheduler, request: Request, resumed: bool) -> CacheHit:
    """The head waiter's prefix hit; with exact tails, its session's turn end if longer."""
    hit = scheduler.cache.find_hit(request.block_hashes, request.num_tokens, resumed=resumed)
    if scheduler.exact_tails and request.session_key is not None:
        hit = _longer_session_hit(scheduler, request, hit, resumed)
    return hit


def _prefetch(scheduler: Scheduler, request: Request, hit: CacheHit, resumed: bool) -> bool:
    """Start loading the host blocks of the head waiter's hit (a prefetch it had already is
    replaced: the hit now holds what it loaded). As an admission does, release other sessions'
    pins while the pool lacks room, and look the hit up again after each: a released pin's
    exact end goes to the host tier, whose saves may drop host keys the hit named. False when
    the loads do not fit even then (or the hit no longer needs the host)."""
    cache = scheduler.cache
    cache.release_prefetch(request.req_id)
    while not cache.prefetch(request.req_id, hit, request.num_tokens):
        if not (scheduler.pinning and cache.release_pin_for_room(keep=request.session_key)):
            return False
        hit = _find_hit(scheduler, request, resumed)
        if not cache.needs_host(hit):
            return False
    return True


def _longer_session_hit(
    scheduler: Scheduler, request: Request, hit: CacheHit, resumed: bool
) -> CacheHit:
    """Exact tails: the session's pinned turn end, where it resumes past the prefix hit."""
    assert request.session_key is not None
    tail = scheduler.cache.session_hit(
        request.session_key, request.block_hashes, request.token_ids, resumed=resumed
    )
    return tail if tail is not None and tail.num_tokens > hit.num_tokens else hit


def _junction(hit: CacheHit, start: int) -> int:
    """The hit's shared-prefix junction, unless received tokens already cover it."""
    return hit.junction if hit.junction > start else 0


def pad_for_drafts(
    scheduler: Scheduler, step: StepState, request: Request, start: int, num_new: int
) -> int:
    """vLLM pads a one-token admission (a full hit, a resumed request; `start` is where its
    computation starts) to the 1 + K rows of a decode with K placeholder drafts when no running
    prefill chunk is in the step, or stops admitting (0) when the budget lacks those rows.
    Otherwise `num_new` unchanged."""
    lookahead = scheduler.num_lookahead_tokens
    if (
        lookahead
        and num_new == 1
        and request.num_tokens - start == 1
        and not step.running_prefill
        and (step.num_running_scheduled or start > 0)
    ):
        if step.budget < 1 + lookahead:
            return 0
        request.draft_token_ids[:] = [PLACEHOLDER_DRAFT] * lookahead
        return 1 + lookahead
    return num_new


def admit(
    scheduler: Scheduler, request: Request, hit: CacheHit, num_new: int, *, start: int
) -> Allocation | None:
    """Allocate the head waiter's hit and first `num_new` tokens after `start` (the hit, or the
    end of the tokens it received) and move it to running; None (nothing taken, still waiting)
    when its blocks do not fit even after releasing pins or its hit is not ready.

    Received tokens take their blocks and are registered as one chunk computed here would be,
    with the state the sender materialised at the chunk's last kept position (a prefill
    checkpoint): the cache ends as if the request had prefilled them here in one chunk."""
    cache = scheduler.cache
    received = start - hit.num_tokens
    while True:
        allocation = cache.allocate(
            request.req_id,
            request.block_hashes,
            num_tokens=request.num_tokens,
            num_computed_tokens=0,
            num_new_tokens=received + num_new,
            num_lookahead_tokens=scheduler.num_lookahead_tokens,
            hit=hit,
            num_prompt_tokens=request.num_tokens,  # a resumed request replays its outputs
            full_sequence_must_fit=scheduler.config.reserve_full_isl,
            received=received > 0,
        )
        if allocation is not None:
            break
        if not hit.ready:
            return None
        # Pins never stall admission: release other sessions' pins, soonest TTL first.
        # Releasing frees blocks without evicting any, so `hit` stays valid: it holds device
        # blocks only (a hit that needs the host tier is prefetched first, and a release may
        # drop host keys: see _prefetch).
        if not (scheduler.pinning and cache.release_pin_for_room(keep=request.session_key)):
            return None
    if scheduler.pinning and request.session_key is not None:
        if hit.from_tail:
            cache.count_tail_hit(request.session_key)
        cache.unpin(request.session_key)  # back, holding its hit: the pin is done
    scheduler.waiting.pop()
    scheduler.running.append(request)
    request.transition(RequestStatus.RUNNING)
    request.num_computed_tokens = start
    request.num_external_computed_tokens = 0  # consumed: a preempted request recomputes
    request.prefix_junction = _junction(hit, start)
    return allocation


def fits_without_preemption(
    scheduler: Scheduler, request: Request, hit: CacheHit, num_new: int
) -> bool:
    """KV-aware admission: admit only if, after this request's blocks, the free pool still
    covers the growth of every running request (and this one) over its remaining output,
    up to the horizon; otherwise admitting it would later force preemptions. Always true
    with nothing running (a lone request can always start)."""
    if not scheduler.running:
        return True
    horizon = scheduler.config.kv_admission_horizon_tokens
    cache = scheduler.cache
    reserve = 0
    for running in scheduler.running:
        room = running.sampling.max_tokens - running.num_output_tokens
        reserve += cache.growth_blocks(running.num_tokens, min(room, horizon))
    own = request.num_tokens - hit.num_tokens
    need = cache.growth_blocks(hit.num_tokens, own + min(request.sampling.max_tokens, horizon))
    return cache.num_free_blocks >= need + reserve
