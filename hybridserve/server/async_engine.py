"""AsyncEngine: the engine steps in its own thread; each request streams through its own queue.

The event loop never touches the engine. Handlers post `add` and `abort` commands to an inbox;
the engine thread applies them between steps, steps while there is work, and hands each step's
deliveries back to the event loop in one batch. Time is the wall clock (seconds since start),
passed to `Engine.step(now)` like any other clock.

Pacing: a backend may ask that a step last at least `pace_s(result)` wall seconds (the
simulator's modelled duration over `--sim-speed`). The step's outputs are held until then, as a
real engine delivers a step's tokens when the step ends (so a TTFT includes the prefill's time),
and the next step waits as long; commands keep being applied while it waits, so an abort frees
its blocks at once.

Faults: a step the executor fails ends its requests with a 500 (the engine already aborted
them and freed their blocks) and the engine carries on; after `max_failed_steps` failed steps
in a row, or any other exception in the loop, the engine is dead: every request fails, every
block is freed, and `on_dead` runs on the event loop (the server then exits non-zero).

Watchdog: a step still running `step_timeout_s` after it began (vLLM's
`VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`) marks the engine dead the same way, from a thread of its
own, without the engine lock the hung step holds: every stream fails at once and the server
exits 1, so a supervisor restarts it.

Metrics: the engine state /metrics shows is a snapshot the engine thread takes under its lock
after each step and after each batch of commands; a scrape reads the last snapshot and never
waits for a step.

Idle pins: with no request in flight the thread still wakes at the next tool-call pin's
deadline and releases what expired, so an idle server's cache empties on schedule.

Shutdown: `drain()` aborts the requests that have not started (a 503); `cut()` ends the rest,
streams with `finish_reason` "abort" and whole responses with a 503.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridserve.core.errors import RequestError
from hybridserve.core.plan import StepResult, TokenLogprob
from hybridserve.core.request import Request
from hybridserve.engine import EngineStep, StepFailed
from hybridserve.engine.assembly import EngineParts
from hybridserve.engine.step_log import StepLog
from hybridserve.server.metrics import ServerMetrics
from hybridserve.server.protocol import ApiError, new_error_id

logger = logging.getLogger(__name__)

# After a step that scheduled nothing while requests remain (none can run yet), wait this long
# or for the next command before stepping again, instead of spinning.
IDLE_STEP_WAIT_S = 0.005
# A paced step that starts at most this late is paced from when it was due (see _step_once).
PACE_CATCH_UP_S = 0.010
# How often the watchdog looks at the running step, at most (smaller for short deadlines).
WATCHDOG_POLL_S = 1.0


@dataclass(frozen=True, slots=True)
class Delivery:
    """What one step gave one request (or why it ended without one)."""

    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None
    error: ApiError | None = None  # the request failed or was cut short
    # With `error`: a stream still ends with `finish_reason` (its text so far stands) while a
    # whole response answers `error`; without it a stream ends with an error event.
    graceful: bool = False
    # For requests that asked for them: one entry per token of `token_ids`, and prompt
    # log-probabilities computed since the last delivery.
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # Set once, on the delivery of the step that first admitted the request: the prompt
    # tokens its prefix hit served.
    num_cached_tokens: int | None = None


@dataclass(slots=True)
class RequestStream:
    req_id: str
    queue: asyncio.Queue[Delivery] = field(default_factory=asyncio.Queue)


@dataclass(slots=True)
class LoopStats:
    """Engine-thread time: inside `Engine.step` (wall and CPU), and busy in all (commands,
    dispatch, metrics)."""

    steps: int = 0
    failed_steps: int = 0
    step_s: float = 0.0
    step_cpu_s: float = 0.0  # the engine thread's CPU time inside `Engine.step`
    busy_s: float = 0.0


def shutdown_error(message: str, retry_after_s: int) -> ApiError:
    return ApiError(
        503,
        message,
        kind="server_error",
        code="shutdown",
        headers={"Retry-After": str(retry_after_s)},
    )


class AsyncEngine:
    def __init__(
        self,
        parts: EngineParts,
        *,
        pace_s: Callable[[StepResult], float],
        metrics: ServerMetrics,
        debug_checks: bool = False,
        max_failed_steps: int = 3,
        retry_after_s: int = 1,
        step_timeout_s: float = 0.0,
        snapshot: Callable[[], Sequence[Any]] = tuple,
        warm_up: Callable[[], object] | None = None,
        step_log: StepLog | None = None,
    ) -> None:
        """`snapshot` reads the engine state /metrics shows (called with the engine lock
        held); `step_timeout_s` is the watchdog's deadline for one step (0: no watchdog);
        `warm_up` runs on the engine thread before its first step (requests that arrive
        meanwhile wait; a failure is logged and serving goes on); `step_log` gets every step
        that scheduled work (closed when the engine thread ends)."""
        if max_failed_steps < 1:
            raise ValueError(f"max_failed_steps={max_failed_steps}; use 1 or more")
        if not step_timeout_s >= 0:  # NaN too
            raise ValueError(f"step_timeout_s={step_timeout_s}; use 0 (off) or more seconds")
        self.parts = parts
        self.metrics = metrics
        self.stats = LoopStats()
        self.max_failed_steps = max_failed_steps
        self.retry_after_s = retry_after_s
        self._pace_s = pace_s
        self._debug_checks = debug_checks
        self._start = time.monotonic()
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Request | str | None]] = []
        self._stopping = False
        # Guards the engine's state: held by the engine thread while it applies commands and
        # steps, and by metric scrapes while they read it.
        self.lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._num_pending_adds = 0
        self._num_waiting = 0
        self._failed_in_a_row = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failure: str | None = None  # why the engine died, if it did (no internals)
        self.on_dead: Callable[[], None] | None = None  # runs on the event loop
        self.step_timeout_s = step_timeout_s
        self._step_began: float | None = None  # monotonic start of the step in flight
        self._read_snapshot = snapshot
        self._warm_up = warm_up
        self._step_log = step_log
        with self.lock:
            self.snapshot: Sequence[Any] = snapshot()  # replaced whole, never mutated

    # ----- event-loop side --------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self._start

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="hybridserve-engine", daemon=True)
        self._thread.start()
        if self.step_timeout_s:
            name = "hybridserve-watchdog"
            threading.Thread(target=self._watch, name=name, daemon=True).start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort what is still in flight, deliver the aborts, and end the engine thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def dead(self) -> bool:
        return self.failure is not None

    def num_queued(self) -> int:
        """Requests accepted but not yet admitted: in the inbox or the scheduler's queue."""
        return self._num_pending_adds + self._num_waiting

    def num_streams(self) -> int:
        """Requests whose clients still wait for deliveries."""
        return len(self._streams)

    def submit(self, request: Request) -> RequestStream:
        """Queue a validated request; its deliveries arrive on the returned stream."""
        stream = RequestStream(request.req_id)
        self._streams[request.req_id] = stream
        with self._cond:
            self._inbox.append(("add", request))
            self._num_pending_adds += 1
            self._cond.notify()
        return stream

    def abort(self, req_id: str) -> None:
        """End `req_id`'s stream with an abort and abort it in the engine (a no-op once it
        finished). Called on the event loop."""
        stream = self._streams.pop(req_id, None)
        if stream is None:
            return
        stream.queue.put_nowait(Delivery((), True, "abort"))
        self._command("abort", req_id)

    def drain(self) -> None:
        """Shutdown, first part: abort every request that has not produced a token yet (their
        clients get a 503); running requests go on."""
        self._command("drain", None)

    def cut(self) -> None:
        """Shutdown, last part: end every request now (streams with finish_reason "abort",
        whole responses with a 503) and free their blocks."""
        self._command("cut", None)

    def _command(self, kind: str, payload: Request | str | None) -> None:
        with self._cond:
            self._inbox.append((kind, payload))
            self._cond.notify()

    def _deliver(self, batch: list[tuple[str, Delivery]]) -> None:
        for req_id, delivery in batch:
            stream = self._streams.get(req_id)
            if stream is None:
                continue  # aborted by its client meanwhile
            stream.queue.put_nowait(delivery)
            if delivery.finished:
                del self._streams[req_id]

    def _fail_all_streams(self) -> None:
        error = ApiError(500, self.failure or "the engine stopped", kind="server_error")
        delivery = Delivery((), True, "abort", error)
        for stream in self._streams.values():
            stream.queue.put_nowait(delivery)
        self._streams.clear()
        if self.on_dead is not None:
            self.on_dead()

    # ----- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        if self._warm_up is not None:
            began = time.monotonic()
            try:
                done = self._warm_up()
                logger.info("warm-up: %s (%.1f s)", done, time.monotonic() - began)
            except Exception:
                logger.exception("the warm-up step failed; serving without it")
        try:
            self._serve_steps()
        except Exception:
            error_id = new_error_id()
            logger.exception("the engine loop failed (error id %s)", error_id)
            self._die(f"the engine failed (error id {error_id})")
        finally:
            if self._step_log is not None:
                self._step_log.close()

    def _die(self, reason: str, *, free_blocks: bool = True) -> None:
        """Mark the engine dead, free every request's blocks (unless a hung step holds the
        engine), and fail every stream."""
        if self.failure is not None:
            return
        self.failure = f"{reason}; the server is exiting"
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if free_blocks:
            try:
                with self.lock:
                    self._abort_all([])
            except Exception:
                logger.exception("freeing the requests of a dead engine failed")
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all_streams)

    def _watch(self) -> None:
        """The watchdog: kill the engine when one step outlives `step_timeout_s`."""
        limit = self.step_timeout_s
        poll = min(WATCHDOG_POLL_S, limit / 4)
        while self.failure is None and not self._stopping:
            began = self._step_began
            if began is not None and (elapsed := time.monotonic() - began) > limit:
                logger.error("a step has run %.1f s, past the %g s step deadline", elapsed, limit)
                self._die(
                    f"a step ran past the {limit:g} s step deadline (--step-timeout); the "
                    "engine is presumed hung",
                    free_blocks=False,
                )
                return
            time.sleep(poll)

    def _serve_steps(self) -> None:
        next_step_at = 0.0
        engine = self.parts.engine
        held: list[tuple[str, Delivery]] = []  # the last step's outputs, until its pace ends
        busy = False  # requests were left after the last step: the next one is due at its end
        while True:
            with self._cond:
                if not self._inbox and not self._stopping:
                    if not engine.has_requests() and not held:
                        self._cond.wait(self._idle_wait_s())
                    elif (delay := next_step_at - time.monotonic()) > 0:
                        self._cond.wait(delay)
                commands, self._inbox = self._inbox, []
                stopping = self._stopping
            busy_from = time.monotonic()
            batch: list[tuple[str, Delivery]] = []
            dead_reason = None
            with self.lock:
                self._apply(commands, batch)
                due = stopping or time.monotonic() >= next_step_at
                if due:  # the last step's pace is over: its outputs go first
                    batch[:0], held = held, []
                if stopping:
                    self._abort_all(batch)
                elif due and engine.has_requests():
                    stepped: list[tuple[str, Delivery]] = []
                    due_at = next_step_at if busy else -math.inf  # an idle engine starts afresh
                    next_step_at, dead_reason = self._step_once(stepped, due=due_at)
                    busy = engine.has_requests()
                    if dead_reason is None and time.monotonic() < next_step_at:
                        held = stepped
                    else:
                        batch.extend(stepped)
                elif not engine.has_requests():
                    engine.release_expired_pins(self.now())
                self.snapshot = self._read_snapshot()
            self._post(batch)
            self.stats.busy_s += time.monotonic() - busy_from
            if dead_reason is not None:
                self._die(dead_reason)
                return
            if stopping:
                return
            # Hand the GIL to the event loop between steps: back-to-back steps would otherwise
            # starve it for a whole switch interval, and new requests would trickle in.
            time.sleep(0)

    def _idle_wait_s(self) -> float | None:
        """How long an idle engine may sleep: until the next pin expires (None: no pin)."""
        deadline = self.parts.engine.next_pin_deadline()
        return None if deadline is None else max(deadline - self.now(), 0.0) + 1e-3

    def _step_once(
        self, batch: list[tuple[str, Delivery]], *, due: float
    ) -> tuple[float, str | None]:
        """One engine step under the watchdog: (when the next step may start, the reason the
        engine must die, if it must). A paced step that starts a little after it was `due` (the
        thread woke late) is paced from `due`, so wake-up latency does not add to every step."""
        engine = self.parts.engine
        step_start, cpu_start = time.monotonic(), time.thread_time()
        self._step_began = step_start
        now = self.now()
        try:
            step = engine.step(now)
        except StepFailed as exc:
            return 0.0, self._after_failed_step(exc, batch)
        finally:
            self._step_began = None
        self._failed_in_a_row = 0
        step_s = time.monotonic() - step_start
        step_cpu_s = time.thread_time() - cpu_start
        late = step_start - due
        next_step_at = (due if 0 <= late < PACE_CATCH_UP_S else step_start) + self._pace_s(
            step.result
        )
        if step.scheduled.is_empty and engine.has_requests():
            next_step_at = max(next_step_at, step_start + IDLE_STEP_WAIT_S)
        self._after_step(step, step_s, step_cpu_s, batch)
        if self._step_log is not None:
            self._step_log.write(step, start_s=now, duration_s=step_s)
        return next_step_at, None

    def _apply(
        self, commands: list[tuple[str, Request | str | None]], batch: list[tuple[str, Delivery]]
    ) -> None:
        engine = self.parts.engine
        for kind, payload in commands:
            if isinstance(payload, Request):
                self._num_pending_adds -= 1
                try:
                    engine.add_request(payload)
                except RequestError as exc:
                    param = "prompt" if exc.field == "prompt_token_ids" else exc.field
                    error = ApiError(400, str(exc), param=param)
                    batch.append((payload.req_id, Delivery((), True, "abort", error)))
            elif kind == "abort" and isinstance(payload, str) and engine.has_request(payload):
                engine.abort(payload)
            elif kind == "drain":
                self._abort_unstarted(batch)
            elif kind == "cut":
                error = shutdown_error(
                    "the server shut down before this request finished", self.retry_after_s
                )
                self._abort_all(batch, Delivery((), True, "abort", error, graceful=True))
        self._num_waiting = engine.num_waiting

    def _abort_unstarted(self, batch: list[tuple[str, Delivery]]) -> None:
        error = shutdown_error(
            "the server is shutting down; this request was not started", self.retry_after_s
        )
        delivery = Delivery((), True, "abort", error)
        for req_id in self.parts.engine.unstarted_request_ids():
            self.parts.engine.abort(req_id)
            batch.append((req_id, delivery))

    def _abort_all(
        self, batch: list[tuple[str, Delivery]], delivery: Delivery | None = None
    ) -> None:
        delivery = delivery or Delivery((), True, "abort")
        for req_id in self.parts.engine.request_ids():
            self.parts.engine.abort(req_id)
            batch.append((req_id, delivery))
        self._num_waiting = 0

    def _after_failed_step(self, exc: StepFailed, batch: list[tuple[str, Delivery]]) -> str | None:
        """Fail the step's requests; the reason the engine must die, if it must."""
        self._failed_in_a_row += 1
        self.stats.failed_steps += 1
        self.metrics.on_failed_step()
        error_id = new_error_id()
        logger.error(
            "step %d failed in the executor (error id %s, %d in a row); aborted %d requests",
            exc.step_id,
            error_id,
            self._failed_in_a_row,
            len(exc.req_ids),
            exc_info=exc.__cause__,
        )
        error = ApiError(
            500,
            f"the executor failed on the step running this request (error id {error_id}); "
            "the request was aborted",
            kind="server_error",
            code="executor_error",
        )
        for req_id in exc.req_ids:
            batch.append((req_id, Delivery((), True, "abort", error)))
        self._num_waiting = self.parts.engine.num_waiting
        if self._failed_in_a_row >= self.max_failed_steps:
            return (
                f"the engine stopped after {self._failed_in_a_row} failed steps in a row "
                f"(last error id {error_id})"
            )
        return None

    def _after_step(
        self, step: EngineStep, step_s: float, step_cpu_s: float, batch: list[tuple[str, Delivery]]
    ) -> None:
        self.stats.steps += 1
        self.stats.step_s += step_s
        self.stats.step_cpu_s += step_cpu_s
        scheduled = step.scheduled
        num_generated = 0
        result = step.result
        for admission in step.admitted:
            cached = Delivery((), False, num_cached_tokens=admission.num_cached_tokens)
            batch.append((admission.req_id, cached))
        for req_id, entries in result.prompt_logprobs.items():
            batch.append((req_id, Delivery((), False, prompt_logprobs=entries)))
        for out in step.outputs:
            num_generated += len(out.new_token_ids)
            # The scheduler may keep fewer tokens than were sampled (a stop, max_tokens).
            logprobs = result.logprobs.get(out.req_id, ())[: len(out.new_token_ids)]
            # A plain string or a FinishReason (a StrEnum): the server speaks its value.
            reason = None if out.finish_reason is None else str(out.finish_reason)
            delivery = Delivery(out.new_token_ids, out.finished, reason, logprobs=logprobs)
            batch.append((out.req_id, delivery))
        refused = dict(scheduled.refused)
        for req_id, reason in step.failed:
            if req_id in refused:  # it can never start in this pool: the request's fault
                logger.warning("request %s refused: %s", req_id, reason)
                error = ApiError(400, reason, param="prompt", code="too_long_for_the_kv_pool")
                batch.append((req_id, Delivery((), True, "abort", error)))
                continue
            error_id = new_error_id()
            logger.error("request %s failed (error id %s): %s", req_id, error_id, reason)
            error = ApiError(
                500,
                f"{reason} for this request (error id {error_id}); the request was aborted",
                kind="server_error",
                code="executor_error",
            )
            batch.append((req_id, Delivery((), True, "abort", error)))
        new_arrivals = [admission.arrival_time for admission in step.admitted]
        num_prompt = sum(admission.num_prompt_tokens for admission in step.admitted)
        self.metrics.on_step(
            now=step.now,
            step_s=step_s,
            step_cpu_s=step_cpu_s,
            executor_s=step.result.duration_s,
            admitted_arrivals=new_arrivals,
            num_prompt_tokens=num_prompt,
            num_generation_tokens=num_generated,
            num_preemptions=len(scheduled.preempted),
        )
        self._num_waiting = self.parts.engine.num_waiting
        if self._debug_checks:
            self.parts.cache.check_invariants()

    def _post(self, batch: list[tuple[str, Delivery]]) -> None:
        if batch and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, batch)
