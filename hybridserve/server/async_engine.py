"""AsyncEngine: the engine steps in its own thread; each request streams through its own queue.

The event loop never touches the engine. Handlers post `add` and `abort` commands to an inbox;
the engine thread applies them between steps, steps while there is work, and hands each step's
deliveries back to the event loop in one batch. Time is the wall clock (seconds since start),
passed to `Engine.step(now)` like any other clock.

Pacing: a backend may ask that a step last at least `pace_s(result)` wall seconds (the
simulator's modelled duration over `--sim-speed`). The next step waits until then; commands
keep being applied while it waits, so an abort frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridserve.core.errors import RequestError
from hybridserve.core.plan import StepResult
from hybridserve.core.request import Request
from hybridserve.engine import EngineStep
from hybridserve.server.backend import EngineParts
from hybridserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Delivery:
    """What one step gave one request (or why it ended without one)."""

    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    status: int = 400  # the HTTP status of `error`


@dataclass(slots=True)
class RequestStream:
    req_id: str
    queue: asyncio.Queue[Delivery] = field(default_factory=asyncio.Queue)


@dataclass(slots=True)
class LoopStats:
    """Engine-thread time: inside `Engine.step` (wall and CPU), and busy in all (commands,
    dispatch, metrics)."""

    steps: int = 0
    step_s: float = 0.0
    step_cpu_s: float = 0.0  # the engine thread's CPU time inside `Engine.step`
    busy_s: float = 0.0


class AsyncEngine:
    def __init__(
        self,
        parts: EngineParts,
        *,
        pace_s: Callable[[StepResult], float],
        metrics: ServerMetrics,
        debug_checks: bool = False,
    ) -> None:
        self.parts = parts
        self.metrics = metrics
        self.stats = LoopStats()
        self._pace_s = pace_s
        self._debug_checks = debug_checks
        self._start = time.monotonic()
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Request | str]] = []
        self._stopping = False
        # Guards the engine's state: held by the engine thread while it applies commands and
        # steps, and by metric scrapes while they read it.
        self.lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._num_pending_adds = 0
        self._num_waiting = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failure: str | None = None  # why the engine thread ended, if it failed

    # ----- event-loop side --------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self._start

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="hybridserve-engine", daemon=True)
        self._thread.start()

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

    def num_queued(self) -> int:
        """Requests accepted but not yet admitted: in the inbox or the scheduler's queue."""
        return self._num_pending_adds + self._num_waiting

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
        with self._cond:
            self._inbox.append(("abort", req_id))
            self._cond.notify()

    def _deliver(self, batch: list[tuple[str, Delivery]]) -> None:
        for req_id, delivery in batch:
            stream = self._streams.get(req_id)
            if stream is None:
                continue  # aborted by its client meanwhile
            stream.queue.put_nowait(delivery)
            if delivery.finished:
                del self._streams[req_id]

    # ----- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve_steps()
        except Exception as exc:
            # A broken engine must not leave streams waiting forever: end every one of them.
            self.failure = f"the engine failed: {type(exc).__name__}: {exc}"
            logger.exception("engine loop failed")
            with self._cond:
                self._stopping = True
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all_streams)

    def _fail_all_streams(self) -> None:
        delivery = Delivery((), True, "abort", self.failure, status=500)
        for stream in self._streams.values():
            stream.queue.put_nowait(delivery)
        self._streams.clear()

    def _serve_steps(self) -> None:
        next_step_at = 0.0
        engine = self.parts.engine
        while True:
            with self._cond:
                if not self._inbox and not self._stopping:
                    if not engine.has_requests():
                        self._cond.wait()
                    elif (delay := next_step_at - time.monotonic()) > 0:
                        self._cond.wait(delay)
                commands, self._inbox = self._inbox, []
                stopping = self._stopping
            busy_from = time.monotonic()
            batch: list[tuple[str, Delivery]] = []
            with self.lock:
                self._apply(commands, batch)
                if stopping:
                    self._abort_all(batch)
                elif engine.has_requests() and time.monotonic() >= next_step_at:
                    step_start, cpu_start = time.monotonic(), time.thread_time()
                    step = engine.step(self.now())
                    step_s = time.monotonic() - step_start
                    step_cpu_s = time.thread_time() - cpu_start
                    next_step_at = step_start + self._pace_s(step.result)
                    self._after_step(step, step_s, step_cpu_s, batch)
            self._post(batch)
            self.stats.busy_s += time.monotonic() - busy_from
            if stopping:
                return
            # Hand the GIL to the event loop between steps: back-to-back steps would otherwise
            # starve it for a whole switch interval, and new requests would trickle in.
            time.sleep(0)

    def _apply(
        self, commands: list[tuple[str, Request | str]], batch: list[tuple[str, Delivery]]
    ) -> None:
        scheduler = self.parts.scheduler
        for kind, payload in commands:
            if isinstance(payload, Request):
                self._num_pending_adds -= 1
                try:
                    self.parts.engine.add_request(payload)
                except RequestError as exc:
                    batch.append((payload.req_id, Delivery((), True, "abort", str(exc))))
            elif kind == "abort" and payload in scheduler.requests:
                self.parts.engine.abort(payload)
        self._num_waiting = scheduler.num_waiting

    def _abort_all(self, batch: list[tuple[str, Delivery]]) -> None:
        for req_id in list(self.parts.scheduler.requests):
            self.parts.engine.abort(req_id)
            batch.append((req_id, Delivery((), True, "abort")))
        self._num_waiting = 0

    def _after_step(
        self, step: EngineStep, step_s: float, step_cpu_s: float, batch: list[tuple[str, Delivery]]
    ) -> None:
        self.stats.steps += 1
        self.stats.step_s += step_s
        self.stats.step_cpu_s += step_cpu_s
        scheduled = step.scheduled
        requests = self.parts.scheduler.requests
        num_generated = 0
        for out in step.outputs:
            num_generated += len(out.new_token_ids)
            batch.append((out.req_id, Delivery(out.new_token_ids, out.finished, out.finish_reason)))
        new_arrivals = []
        num_prompt = 0
        for req_id, _ in scheduled.new_reqs:
            request = requests.get(req_id)
            if request is not None:
                new_arrivals.append(request.arrival_time)
                num_prompt += request.num_prompt_tokens
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
        self._num_waiting = scheduled.num_waiting
        if self._debug_checks:
            self.parts.cache.check_invariants()

    def _post(self, batch: list[tuple[str, Delivery]]) -> None:
        if batch and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, batch)
