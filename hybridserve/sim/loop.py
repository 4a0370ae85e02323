"""The discrete-event loop: drives the real Engine on simulated time.

Events are ordered by (time, sequence number), so ties resolve the same way every run (SimPy's
rule). The engine steps back to back while it has work; each step takes the duration the
executor reports. Agents wait their tool time after each answer and send the next turn.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine import Engine, EngineStep
from hybridserve.metrics.recorder import MetricsRecorder
from hybridserve.sim.workload import AgentWorkload, Job, Turn


@dataclass(order=True, slots=True)
class _Event:
    time_s: float
    seq: int
    turn: Turn = field(compare=False)


class AgentSimulation:
    """E1: agents run jobs back to back against one engine."""

    def __init__(
        self,
        engine: Engine,
        workload: AgentWorkload,
        *,
        recorder: MetricsRecorder | None = None,
        on_step: Callable[[EngineStep], None] | None = None,
    ) -> None:
        self.engine = engine
        self.workload = workload
        self.recorder = recorder if recorder is not None else MetricsRecorder()
        self.on_step = on_step
        self.now = 0.0
        self._events: list[_Event] = []
        self._seq = 0
        self._jobs: dict[str, Job] = {}
        self._turn_of: dict[str, Turn] = {}
        self._answers: dict[str, list[int]] = {}
        self.steps = 0

    def _schedule(self, time_s: float, turn: Turn) -> None:
        heapq.heappush(self._events, _Event(time_s, self._seq, turn))
        self._seq += 1

    def _start_job(self, agent: int, time_s: float) -> None:
        job = self.workload.new_job(agent)
        self._jobs[job.job_id] = job
        self.recorder.on_job_start(job.job_id, time_s)
        self._next_turn(job, time_s)

    def _next_turn(self, job: Job, time_s: float) -> None:
        turn = self.workload.next_turn(job)
        if turn is None:
            self._end_job(job, time_s)
            return
        self._schedule(time_s, turn)

    def _end_job(self, job: Job, time_s: float) -> None:
        self.recorder.on_job_finish(job.job_id, time_s)
        self._start_job(job.agent, time_s)  # the agent starts its next job at once

    def run(self, until_s: float) -> MetricsRecorder:
        """Simulate until `until_s` seconds of simulated time."""
        for agent in range(self.workload.params.num_agents):
            self._start_job(agent, 0.0)
        while self.now < until_s:
            self._admit_arrivals()
            if self.engine.has_requests():
                self._step()
            elif self._events:
                self.now = self._events[0].time_s
            else:
                break
        return self.recorder

    def _admit_arrivals(self) -> None:
        while self._events and self._events[0].time_s <= self.now:
            turn = heapq.heappop(self._events).turn
            req_id = f"{turn.job_id}.t{turn.turn}"
            self.engine.add_request(
                Request(
                    req_id=req_id,
                    prompt_token_ids=tuple(turn.prompt),
                    sampling=SamplingParams(max_tokens=turn.max_tokens, ignore_eos=True),
                    arrival_time=self.now,
                )
            )
            self._turn_of[req_id] = turn
            self._answers[req_id] = []
            self.recorder.on_arrival(req_id, self.now, len(turn.prompt), turn.job_id)
            self.recorder.on_job_turn(turn.job_id)

    def _step(self) -> None:
        step = self.engine.step(self.now)
        self.steps += 1
        end = self.now + max(step.result.duration_s, 1e-6)
        recorder = self.recorder
        recorder.preemptions += len(step.scheduled.preempted)
        for req_id, hit in (*step.scheduled.new_reqs,):
            recorder.on_admitted(req_id, hit)
        for output in step.outputs:
            recorder.on_delivery(output.req_id, end, len(output.new_token_ids))
            self._answers[output.req_id].extend(output.new_token_ids)
            if output.finished:
                self._finish(output.req_id, end)
        if self.on_step is not None:
            self.on_step(step)
        self.now = end

    def _finish(self, req_id: str, time_s: float) -> None:
        self.recorder.on_finish(req_id, time_s)
        turn = self._turn_of.pop(req_id)
        job = self._jobs[turn.job_id]
        tool_time = self.workload.after_answer(job, self._answers.pop(req_id))
        if self.workload.is_over(job):
            self._end_job(job, time_s)  # a job ends when its last turn does
        else:
            self._next_turn(job, time_s + tool_time)
