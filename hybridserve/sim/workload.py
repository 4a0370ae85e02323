"""Agent workload (experiment E1): N agents run multi-turn jobs back to back.

A job's turn 0 is a shared system/tool prompt plus a unique task. Each turn the model answers;
the agent waits a tool time, appends the answer and a (heavy-tailed) tool result, and sends the
grown context as the next prompt. A job ends after its last turn, or when the context would pass
the context limit. Defaults and their evidence: DESIGN.md section 6 (E1 table).

Every agent draws from its own seeded streams (its jobs, its answer lengths, its tools), so a
seed fixes each agent's sequence of jobs whatever the engine does: two configurations on one seed
are compared on the same jobs, and their per-seed ratios are paired.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from hybridserve.core.errors import ConfigError

_TASK_BASE = 1 << 32  # synthesised task and tool tokens live above any model vocabulary
_ANSWER_BASE = 1 << 62  # synthetic answers (SyntheticAnswers(positive=True)) above those
_AGENT_TOKEN_BITS = 40  # each agent's fresh tokens come from its own range of 2^40 ids


@dataclass(frozen=True, kw_only=True, slots=True)
class LogNormal:
    """LN(median, sigma), clipped to [low, high]."""

    median: float
    sigma: float
    low: float = 0.0
    high: float = math.inf

    def sample(self, rng: random.Random) -> float:
        value = self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        return min(max(value, self.low), self.high)


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentParams:
    num_agents: int = 20
    system_prompt_tokens: int = 12_000
    task_tokens: LogNormal = LogNormal(median=500, sigma=0.8, low=50, high=8_000)
    turns_per_job: LogNormal = LogNormal(median=30, sigma=0.7, low=3, high=250)
    output_tokens: LogNormal = LogNormal(median=150, sigma=1.5, low=1, high=8_192)
    tool_result_tokens: LogNormal = LogNormal(median=300, sigma=1.5, low=1, high=25_000)
    tool_time_fast: LogNormal = LogNormal(median=0.5, sigma=1.0, high=600)
    tool_time_slow: LogNormal = LogNormal(median=6.0, sigma=1.8, high=600)
    slow_tool_fraction: float = 0.08
    context_limit: int = 131_072

    def __post_init__(self) -> None:
        if self.num_agents < 1:
            raise ConfigError("agents.num_agents", self.num_agents, "use 1 or more agents")
        if not 0.0 <= self.slow_tool_fraction <= 1.0:
            raise ConfigError(
                "agents.slow_tool_fraction", self.slow_tool_fraction, "use a value in [0, 1]"
            )
        if self.system_prompt_tokens + 1 >= self.context_limit:
            raise ConfigError(
                "agents.system_prompt_tokens",
                self.system_prompt_tokens,
                f"it must leave room below context_limit={self.context_limit}",
            )

    def with_medians(
        self, *, output_tokens: float | None = None, tool_result_tokens: float | None = None
    ) -> AgentParams:
        """These parameters with the answer and tool-result medians replaced where given (the
        `--output-tokens` and `--tool-result-tokens` options)."""
        params = self
        if output_tokens is not None:
            params = replace(
                params, output_tokens=replace(params.output_tokens, median=output_tokens)
            )
        if tool_result_tokens is not None:
            tool = replace(params.tool_result_tokens, median=tool_result_tokens)
            params = replace(params, tool_result_tokens=tool)
        return params

    def with_tool_times_scaled(self, scale: float) -> AgentParams:
        """Tool times x `scale` (median and cap), drawn from the same random numbers: what the
        load generator's `--time-scale` does to its waits, for a simulated twin."""
        fast, slow = self.tool_time_fast, self.tool_time_slow
        return replace(
            self,
            tool_time_fast=replace(fast, median=fast.median * scale, high=fast.high * scale),
            tool_time_slow=replace(slow, median=slow.median * scale, high=slow.high * scale),
        )


class SyntheticAnswers:
    """Per agent, a run of fresh ids: the answer tokens a job appends in place of what the
    server generated (`agents --url`). Negative ids by default (they collide with no prompt
    token; the load generator maps them onto the vocabulary); `positive`: ids from 2^62 up,
    above every synthesised prompt token, for an engine that takes only ids >= 0."""

    def __init__(self, *, positive: bool = False) -> None:
        self._next: dict[int, int] = {}
        self._positive = positive

    def take(self, agent: int, count: int) -> list[int]:
        start = self._next.get(agent, 0)
        self._next[agent] = start + count
        if self._positive:
            base = _ANSWER_BASE + (agent << 40) + start
            return list(range(base, base + count))
        base = -(1 + (agent << 40) + start)
        return list(range(base, base - count, -1))


@dataclass(slots=True)
class Turn:
    """One request of a job: the prompt to send and how long the answer may be."""

    job_id: str
    turn: int
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Job:
    job_id: str
    agent: int
    num_turns: int
    history: list[int]
    turn: int = 0


class _AgentStreams:
    """One agent's random streams, one per kind of draw, each seeded from (seed, agent, kind):
    what an agent draws never depends on what the others drew or on when the engine answered,
    so two configurations run on one seed see the same jobs (common random numbers)."""

    __slots__ = ("jobs", "next_token", "num_jobs", "outputs", "tools")

    def __init__(self, seed: int, agent: int) -> None:
        self.jobs = random.Random(f"{seed}/agent{agent}/jobs")  # task length, turn count
        self.outputs = random.Random(f"{seed}/agent{agent}/outputs")  # answer lengths
        self.tools = random.Random(f"{seed}/agent{agent}/tools")  # results, slow?, tool time
        self.next_token = _TASK_BASE + (agent << _AGENT_TOKEN_BITS)
        self.num_jobs = 0


class AgentWorkload:
    """Generates jobs and turns; deterministic for a seed, and per agent (see _AgentStreams)."""

    def __init__(self, params: AgentParams, *, seed: int) -> None:
        self.params = params
        self.seed = seed
        self.system_prompt = list(range(params.system_prompt_tokens))
        self._streams: dict[int, _AgentStreams] = {}

    def _agent(self, agent: int) -> _AgentStreams:
        streams = self._streams.get(agent)
        if streams is None:
            streams = self._streams[agent] = _AgentStreams(self.seed, agent)
        return streams

    def _fresh_tokens(self, agent: int, count: int) -> list[int]:
        streams = self._agent(agent)
        start = streams.next_token
        streams.next_token += count
        return list(range(start, start + count))

    def new_job(self, agent: int) -> Job:
        p, streams = self.params, self._agent(agent)
        job_id = f"a{agent}.j{streams.num_jobs}"
        streams.num_jobs += 1
        task = self._fresh_tokens(agent, int(p.task_tokens.sample(streams.jobs)))
        turns = round(p.turns_per_job.sample(streams.jobs))
        return Job(job_id, agent, turns, [*self.system_prompt, *task])

    def is_over(self, job: Job) -> bool:
        """No turn is left, or the context has no room for another."""
        return job.turn >= job.num_turns or self.params.context_limit - len(job.history) <= 1

    def next_turn(self, job: Job) -> Turn | None:
        """The job's next request, or None when the job is over."""
        if self.is_over(job):
            return None
        room = self.params.context_limit - len(job.history)
        wanted = int(self.params.output_tokens.sample(self._agent(job.agent).outputs))
        turn = Turn(job.job_id, job.turn, list(job.history), max(min(wanted, room - 1), 1))
        job.turn += 1
        return turn

    def after_answer(self, job: Job, answer: list[int]) -> float:
        """Append the answer and a tool result to the job's history; returns the tool time."""
        p, rng = self.params, self._agent(job.agent).tools
        result = self._fresh_tokens(job.agent, int(p.tool_result_tokens.sample(rng)))
        job.history.extend(answer)
        job.history.extend(result)
        slow = rng.random() < p.slow_tool_fraction
        return (p.tool_time_slow if slow else p.tool_time_fast).sample(rng)
