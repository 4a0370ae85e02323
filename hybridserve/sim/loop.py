"""The discrete-event loop: drives the real Engine on simulated time.

Arrivals are ordered by (time, sequence number), so ties resolve the same way every run
(SimPy's rule). The engine steps back to back while it has work; each step takes the duration
the executor reports, and its outputs are delivered at the step's end. `AgentSimulation` sends
each job's next turn a tool time after an answer; `OpenLoopSimulation` replays fixed arrivals.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from hybridserve.core.errors import RequestError
from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine import Engine, EngineStep
from hybridserve.metrics.recorder import MetricsRecorder
from hybridserve.sim.workload import AgentWorkload, Job, SyntheticAnswers, Turn


@dataclass(order=True, slots=True)
class Arrival:
    time_s: float
    seq: int
    req_id: str = field(compare=False)
    prompt: list[int] = field(compare=False)
    max_tokens: int = field(compare=False)
    job_id: str | None = field(compare=False, default=None)


class Simulation:
    """The shared loop: arrivals in, engine steps, deliveries and finishes out."""

    def __init__(
        self,
        engine: Engine,
        *,
        recorder: MetricsRecorder | None = None,
        on_step: Callable[[EngineStep], None] | None = None,
    ) -> None:
        self.engine = engine
        self.recorder = recorder if recorder is not None else MetricsRecorder()
        self.on_step = on_step
        self.now = 0.0
        self.steps = 0
        # GPU seconds of the steps that end at or after `breakdown_from_s`, by kind of step.
        self.breakdown_from_s = 0.0
        self.gpu_seconds = {"decode": 0.0, "prefill": 0.0, "mixed": 0.0}
        # Per request: prompt tokens an ideal prefix cache would hold (AgentSimulation).
        self.ideal_prefix: dict[str, int] = {}
        self._arrivals: list[Arrival] = []
        self._seq = 0
        self._answers: dict[str, list[int]] = {}
        # Arrivals the engine refused (a prompt longer than max_model_len, ...): id, length and
        # the reason. They are counted and reported; the run goes on without them.
        self.rejected: list[tuple[str, int, str]] = []
        # Agent jobs that ended with a turn refused (out of job goodput).
        self.jobs_failed = 0

    def schedule_arrival(
        self, time_s: float, req_id: str, prompt: list[int], max_tokens: int, job_id: str | None
    ) -> None:
        heapq.heappush(
            self._arrivals, Arrival(time_s, self._seq, req_id, prompt, max_tokens, job_id)
        )
        self._seq += 1

    def run(self, until_s: float) -> MetricsRecorder:
        """Simulate until `until_s` seconds of simulated time, or until nothing is left."""
        self.start()
        while self.now < until_s:
            self._admit_arrivals()
            if self.engine.has_requests():
                self._step()
            elif self._arrivals:
                self.now = self._arrivals[0].time_s
            else:
                break
        return self.recorder

    def start(self) -> None:
        """Schedule the first arrivals."""

    def finished(self, req_id: str, time_s: float, answer: list[int]) -> None:
        """A request finished at `time_s` with these output tokens."""

    # ----- what a loop over several engines (the fleet) shares with this one -----------------

    def next_arrival_s(self) -> float | None:
        """When the next scheduled arrival is due (None: none is left)."""
        return self._arrivals[0].time_s if self._arrivals else None

    def due_arrivals(self, now: float) -> Iterator[Arrival]:
        """Take, in order, every arrival due by `now`."""
        while self._arrivals and self._arrivals[0].time_s <= now:
            yield heapq.heappop(self._arrivals)

    def request_for(self, arrival: Arrival, *, max_tokens: int | None = None) -> Request:
        """The engine request of `arrival`, in its session (its job), as every loop builds it;
        `max_tokens` caps the answer (a prefill replica answers one token and hands off)."""
        return Request(
            req_id=arrival.req_id,
            prompt_token_ids=tuple(arrival.prompt),
            sampling=SamplingParams(
                max_tokens=arrival.max_tokens if max_tokens is None else max_tokens,
                ignore_eos=True,
            ),
            arrival_time=arrival.time_s,
            session_id=arrival.job_id,
        )

    def admit(self, arrival: Arrival, engine: Engine, *, max_tokens: int | None = None) -> bool:
        """Add `arrival` to `engine` and record it; an arrival the engine refuses (a prompt past
        max_model_len, ...) is counted in `rejected` and the run goes on. True if admitted."""
        try:
            engine.add_request(self.request_for(arrival, max_tokens=max_tokens))
        except RequestError as exc:
            self.fail(arrival.req_id, len(arrival.prompt), str(exc))
            return False
        self._answers[arrival.req_id] = []
        self.recorder.on_arrival(
            arrival.req_id, arrival.time_s, len(arrival.prompt), arrival.job_id
        )
        return True

    def reject(self, req_id: str, num_tokens: int, reason: str) -> None:
        self.rejected.append((req_id, num_tokens, reason))

    def fail(self, req_id: str, num_tokens: int, reason: str) -> None:
        """The engine refused `req_id` (at admission or as a waiter that can never start):
        counted in `rejected`, forgotten, and its sender told (`request_failed`)."""
        self._answers.pop(req_id, None)
        self.reject(req_id, num_tokens, reason)
        self.request_failed(req_id)

    def request_failed(self, req_id: str) -> None:
        """A request ended without an answer; what sent it goes on (AgentSimulation)."""

    def answer(self, req_id: str) -> list[int]:
        """The output tokens delivered so far to `req_id` (the live list: extend it)."""
        return self._answers[req_id]

    def take_answer(self, req_id: str) -> list[int]:
        """The finished request's whole answer; it is forgotten here."""
        return self._answers.pop(req_id)

    def _admit_arrivals(self) -> None:
        for arrival in self.due_arrivals(self.now):
            self.admit(arrival, self.engine)

    def _step(self) -> None:
        step = self.engine.step(self.now)
        self.steps += 1
        end = self.now + max(step.result.duration_s, 1e-6)
        recorder = self.recorder
        scheduled = step.scheduled
        recorder.preemptions += len(scheduled.preempted)
        if end >= self.breakdown_from_s and (
            scheduled.num_prefill_tokens or scheduled.num_decode_tokens
        ):
            if not scheduled.num_prefill_tokens:
                kind = "decode"
            elif not scheduled.num_decode_tokens:
                kind = "prefill"
            else:
                kind = "mixed"
            self.gpu_seconds[kind] += end - self.now
        recorder.timeline.on_step(
            end,
            duration_s=end - self.now,
            prefill=scheduled.num_prefill_tokens,
            decode=scheduled.num_decode_tokens,
            kv_usage=scheduled.kv_usage,
        )
        for req_id, hit in step.scheduled.new_reqs:
            recorder.on_admitted(req_id, hit)
        for req_id, why in step.failed:  # waiters the engine refused: they could never start
            record = recorder.requests.get(req_id)
            self.fail(req_id, record.prompt_tokens if record is not None else 0, why)
        for output in step.outputs:
            recorder.on_delivery(output.req_id, end, len(output.new_token_ids))
            self._answers[output.req_id].extend(output.new_token_ids)
            if output.finished:
                recorder.on_finish(output.req_id, end)
                self.finished(output.req_id, end, self._answers.pop(output.req_id))
        if self.on_step is not None:
            self.on_step(step)
        self.now = end


class OpenLoopSimulation(Simulation):
    """Requests arrive at fixed times (a trace, a Poisson process), whatever the engine does."""

    def __init__(
        self,
        engine: Engine,
        arrivals: Iterable[tuple[float, str, list[int], int]],
        **kwargs: object,
    ) -> None:
        super().__init__(engine, **kwargs)  # type: ignore[arg-type]
        for time_s, req_id, prompt, max_tokens in arrivals:
            self.schedule_arrival(time_s, req_id, prompt, max_tokens, None)


class AgentSimulation(Simulation):
    """E1: agents run jobs back to back against one engine."""

    def __init__(
        self,
        engine: Engine,
        workload: AgentWorkload,
        *,
        synthetic_answers: bool = False,
        **kwargs: object,
    ) -> None:
        super().__init__(engine, **kwargs)  # type: ignore[arg-type]
        self.workload = workload
        # The load generator's answers (`agents --url`): fresh tokens, not the engine's, so no
        # turn reuses the KV of the answer before it.
        self._synthetic = SyntheticAnswers(positive=True) if synthetic_answers else None
        # The answers of turns the engine refused: drawn, as the load generator's are.
        self._stand_in = self._synthetic or SyntheticAnswers(positive=True)
        self._failed_jobs: set[str] = set()
        self._jobs: dict[str, Job] = {}
        self._turn_of: dict[str, Turn] = {}
        # Tokens of each job whose KV exists (its last prompt and answer, less the last sampled
        # token, never fed back): what an ideal cache would hit. The shared system prompt counts
        # once any earlier request has sent it (an upper bound: it may still be in prefill).
        self._computed: dict[str, int] = {}
        self._system_sent = False

    def start(self) -> None:
        for agent in range(self.workload.params.num_agents):
            self._start_job(agent, 0.0)

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
        req_id = f"{turn.job_id}.t{turn.turn}"
        self._turn_of[req_id] = turn
        shared = len(self.workload.system_prompt) if self._system_sent else 0
        self.ideal_prefix[req_id] = self._computed.get(turn.job_id, shared)
        self._system_sent = True
        self.recorder.on_job_turn(turn.job_id)
        self.schedule_arrival(time_s, req_id, turn.prompt, turn.max_tokens, turn.job_id)

    def _end_job(self, job: Job, time_s: float) -> None:
        if job.job_id in self._failed_jobs:
            self._failed_jobs.discard(job.job_id)
            self.jobs_failed += 1  # not a finished job: out of job goodput
        else:
            self.recorder.on_job_finish(job.job_id, time_s)
        self._start_job(job.agent, time_s)  # the agent starts its next job at once

    def request_failed(self, req_id: str) -> None:
        """A turn the engine refused: as `agents --url` does with a failed request, the job
        goes on with an answer of the drawn length (so the turns that follow are the ones a
        served turn would have led to) and counts as failed when it ends. Without this the
        agent would wait for the answer forever and the run would lose it."""
        turn = self._turn_of.pop(req_id, None)
        if turn is None:  # not a turn of ours (a RAG tenant's request, say)
            return
        job = self._jobs[turn.job_id]
        self._failed_jobs.add(job.job_id)
        answer = self._stand_in.take(job.agent, turn.max_tokens)
        tool_time = self.workload.after_answer(job, answer)
        if self.workload.is_over(job):
            self._computed.pop(job.job_id, None)
            self._jobs.pop(job.job_id, None)
            self._end_job(job, self.now)
        else:
            self._next_turn(job, self.now + tool_time)

    def finished(self, req_id: str, time_s: float, answer: list[int]) -> None:
        turn = self._turn_of.pop(req_id)
        job = self._jobs[turn.job_id]
        self._computed[job.job_id] = len(turn.prompt) + len(answer) - 1
        if self._synthetic is not None:
            answer = self._synthetic.take(job.agent, len(answer))
            self._computed[job.job_id] = len(turn.prompt)
        tool_time = self.workload.after_answer(job, answer)
        if self.workload.is_over(job):
            self._computed.pop(job.job_id, None)
            self._jobs.pop(job.job_id, None)
            self._end_job(job, time_s)  # a job ends when its last turn does
        else:
            self._next_turn(job, time_s + tool_time)
