"""Waiting queues: FCFS (a deque; preempted requests go to the front), FCFS with a deadline
(requests that waited past it go behind the rest), priority (a heap) and program-level priority
(turns ordered by their session's attained service or arrival)."""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterator
from itertools import chain

from hybridserve.core.config import ProgramPriority
from hybridserve.core.request import Request

MAX_PROGRAMS = 65_536  # programs whose service or arrival is remembered (oldest forgotten)


class FcfsQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class DeadlineQueue:
    """FCFS, except that a request that has waited `deadline_s` (its time to first token can no
    longer meet the SLO) goes behind every request that has not, and late requests keep their
    arrival order among themselves. Preempted requests go to the front, as in vLLM.

    Below saturation nobody waits that long and the order is vLLM's FCFS. Past it, FCFS spends
    every prefill on a request that already missed its first-token deadline, so every request
    misses it; this order spends it on requests that can still make it, and serves the late ones
    when the load allows (their wait grows instead). `advance(now)` is called by the scheduler
    at every step; arrivals come in time order, so the late ones are always at the head.
    """

    def __init__(self, deadline_s: float) -> None:
        if not deadline_s > 0:
            raise ValueError("a deadline queue needs a positive deadline")
        self.deadline_s = deadline_s
        self._front: deque[Request] = deque()  # preempted: resumed first
        self._fresh: deque[Request] = deque()  # within the deadline, in arrival order
        self._late: deque[Request] = deque()  # past it, in arrival order
        self.num_demoted = 0  # requests that went behind the rest (a counter for metrics)

    def advance(self, now: float) -> None:
        """Move the requests that have waited `deadline_s` by `now` behind the rest."""
        fresh = self._fresh
        while fresh and now - fresh[0].arrival_time >= self.deadline_s:
            self._late.append(fresh.popleft())
            self.num_demoted += 1

    def add(self, request: Request) -> None:
        self._fresh.append(request)

    def prepend(self, request: Request) -> None:
        self._front.appendleft(request)

    def _head(self) -> deque[Request]:
        for part in (self._front, self._fresh, self._late):
            if part:
                return part
        raise IndexError("peek from an empty queue")

    def peek(self) -> Request:
        return self._head()[0]

    def pop(self) -> Request:
        return self._head().popleft()

    def remove(self, request: Request) -> None:
        for part in (self._front, self._fresh, self._late):
            if request in part:
                part.remove(request)
                return
        raise ValueError(f"{request.req_id} is not waiting")

    def __len__(self) -> int:
        return len(self._front) + len(self._fresh) + len(self._late)

    def __bool__(self) -> bool:
        return bool(self._front or self._fresh or self._late)

    def __iter__(self) -> Iterator[Request]:
        """In admission order."""
        return chain(self._front, self._fresh, self._late)


class PriorityQueue:
    """Lower `priority` first, then earlier arrival; a preempted request simply re-enters."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = 0

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, self._seq, request))
        self._seq += 1

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))


class ProgramQueue:
    """Waiting turns ordered by their program (session; a request without one is its own).

    PLAS: least attained service first, the service being the tokens the program has had
    scheduled (Autellix's program-level least attained service, in tokens). FCFS: the program
    that arrived first goes first (Continuum's program-level FCFS). Ties go to the earlier turn.
    Starvation is bounded: a turn that has waited `max_wait_s` goes ahead of every turn that has
    not, and aged turns go in arrival order. Preempted requests go to the front, as in vLLM.
    `now` is set by the scheduler at every step.
    """

    def __init__(self, mode: ProgramPriority, max_wait_s: float) -> None:
        if mode is ProgramPriority.OFF:
            raise ValueError("a program queue needs plas or fcfs")
        self.mode = mode
        self.max_wait_s = max_wait_s
        self.now = 0.0
        self._front: deque[Request] = deque()
        self._items: dict[int, Request] = {}  # insertion sequence -> request
        self._seq = 0
        self._service: OrderedDict[str, float] = OrderedDict()
        self._program_arrival: OrderedDict[str, float] = OrderedDict()

    @staticmethod
    def program_of(request: Request) -> str:
        return request.session_key if request.session_key is not None else f"req:{request.req_id}"

    def add_service(self, request: Request, tokens: int) -> None:
        """Charge `tokens` of scheduled work to the request's program."""
        program = self.program_of(request)
        self._service[program] = self._service.get(program, 0.0) + tokens
        self._service.move_to_end(program)
        if len(self._service) > MAX_PROGRAMS:
            self._service.popitem(last=False)

    def service(self, program: str) -> float:
        return self._service.get(program, 0.0)

    def add(self, request: Request) -> None:
        program = self.program_of(request)
        if program not in self._program_arrival:
            self._program_arrival[program] = request.arrival_time
            if len(self._program_arrival) > MAX_PROGRAMS:
                self._program_arrival.popitem(last=False)
        self._items[self._seq] = request
        self._seq += 1

    def prepend(self, request: Request) -> None:
        self._front.appendleft(request)

    def _key(self, seq: int, request: Request) -> tuple[int, float, float, int]:
        if self.now - request.arrival_time >= self.max_wait_s:
            return (0, request.arrival_time, 0.0, seq)  # aged: arrival order, before the rest
        program = self.program_of(request)
        if self.mode is ProgramPriority.PLAS:
            rank = self._service.get(program, 0.0)
        else:
            rank = self._program_arrival.get(program, request.arrival_time)
        return (1, rank, request.arrival_time, seq)

    def _head_seq(self) -> int:
        return min(self._items.items(), key=lambda item: self._key(*item))[0]

    def peek(self) -> Request:
        if self._front:
            return self._front[0]
        if not self._items:
            raise IndexError("peek from an empty queue")
        return self._items[self._head_seq()]

    def pop(self) -> Request:
        if self._front:
            return self._front.popleft()
        if not self._items:
            raise IndexError("pop from an empty queue")
        return self._items.pop(self._head_seq())

    def remove(self, request: Request) -> None:
        if request in self._front:
            self._front.remove(request)
            return
        for seq, item in self._items.items():
            if item is request:
                del self._items[seq]
                return
        raise ValueError(f"{request.req_id} is not waiting")

    def __len__(self) -> int:
        return len(self._front) + len(self._items)

    def __bool__(self) -> bool:
        return bool(self._front or self._items)

    def __iter__(self) -> Iterator[Request]:
        """In admission order."""
        ranked = sorted(self._items.items(), key=lambda item: self._key(*item))
        return iter([*self._front, *(request for _, request in ranked)])


WaitingQueue = FcfsQueue | DeadlineQueue | PriorityQueue | ProgramQueue
