"""Engine.step(): schedule, execute, update, outputs. Time is passed in; no wall clock here."""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.core.plan import StepResult
from hybridserve.core.request import Request
from hybridserve.executor.api import Executor
from hybridserve.scheduler import Scheduler, SchedulerOutput
from hybridserve.scheduler.scheduler import RequestOutput


@dataclass(frozen=True, slots=True)
class EngineStep:
    now: float
    scheduled: SchedulerOutput
    result: StepResult
    outputs: list[RequestOutput]


class Engine:
    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor

    def add_request(self, request: Request) -> None:
        """Validate and queue; raises RequestError with nothing queued on bad input."""
        self.scheduler.add_request(request)

    def abort(self, req_id: str) -> None:
        self.scheduler.abort(req_id)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests()

    def step(self, now: float = 0.0) -> EngineStep:
        scheduled = self.scheduler.schedule(now)
        result = self.executor.execute(scheduled.plan)
        outputs = self.scheduler.update(scheduled, result)
        return EngineStep(now, scheduled, result, outputs)
