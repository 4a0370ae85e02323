"""`hybridserve agents`: the E1 agent workload (or a trace's arrivals) against a running server.

The agents are the simulator's (`hybridserve.sim.workload.AgentWorkload`: the same per-agent
seeded streams), run in wall-clock time: each agent sends its job's turn, waits for the whole
streamed answer, waits the drawn tool time times `time_scale`, and sends the next turn; a job
ends after its last turn or at the context limit, and the agent starts its next job at once. A
trace (`mooncake:PATH`, `azure:PATH`) is replayed open-loop, each request at its arrival time.

Every request's timings go into the same `MetricsRecorder` the simulator fills, on the client's
clock (seconds since the run began), so the summary has the same keys over the same window
[warmup_s, duration_s]. A request that fails (an HTTP status, an error in the stream, a dropped
connection) is counted by status and left unfinished (out of the latency statistics); its job
goes on with the drawn answer, so failures never change the request sequence, but the job
counts as failed, not toward job goodput. Requests still running at `duration_s` are cut and
counted apart (`requests_unfinished_at_end`).

What makes two servers on one seed receive identical request sequences: the agent streams, the
answer lengths as `max_tokens` with `ignore_eos`, and synthetic answer tokens appended to the
history instead of the server's (`hybridserve.loadgen.tokens`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from hybridserve.core.errors import ConfigError
from hybridserve.loadgen.client import (
    Completion,
    completion_body,
    request_headers,
    served_model,
    stream_completion,
)
from hybridserve.loadgen.tokens import SyntheticAnswers, TokenMap, echoed
from hybridserve.metrics.recorder import MetricsRecorder
from hybridserve.metrics.slo import meets_slo, slo_goodput
from hybridserve.sim.workload import AgentParams, AgentWorkload, Job

Arrival = tuple[float, str, list[int], int]  # (seconds, request id, prompt ids, max tokens)
ANSWERS = ("synthetic", "server")
Progress = Callable[[float, "LoadStats"], None]  # (seconds elapsed, counts so far)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadConfig:
    url: str
    model: str | None = None  # None: the first model /v1/models lists
    api_key: str | None = None
    seed: int = 0
    duration_s: float = 600.0  # the run's end; the window is [warmup_s, duration_s]
    warmup_s: float = 60.0
    time_scale: float = 1.0  # wall seconds per drawn tool second (trace: per trace second)
    concurrency_limit: int | None = None  # requests in flight at once (None: no limit)
    vocab_size: int = 256  # prompt ids are sent in [0, vocab_size)
    request_timeout_s: float = 600.0
    # What a job appends after each answer: drawn tokens ("synthetic": the same sequence on
    # every server) or the tokens the server generated ("server", as a real agent does).
    answers: str = "synthetic"

    def __post_init__(self) -> None:
        if not self.warmup_s >= 0:
            raise ConfigError("--warmup", self.warmup_s, "use 0 or more seconds")
        if not self.duration_s > self.warmup_s:
            raise ConfigError(
                "--duration",
                self.duration_s,
                f"the run's length must exceed --warmup={self.warmup_s}: raise it",
            )
        if not self.time_scale > 0 or math.isinf(self.time_scale):
            raise ConfigError("--time-scale", self.time_scale, "use a factor > 0 (1 = real time)")
        if self.concurrency_limit is not None and self.concurrency_limit < 1:
            raise ConfigError("--concurrency-limit", self.concurrency_limit, "use 1 or more")
        if not self.request_timeout_s > 0:
            raise ConfigError("--request-timeout", self.request_timeout_s, "use > 0 seconds")
        if self.answers not in ANSWERS:
            raise ConfigError("--answers", self.answers, f"use one of {', '.join(ANSWERS)}")


@dataclass(slots=True)
class SentRequest:
    """What one request carried (for checks that two servers saw the same sequence)."""

    req_id: str
    session_id: str | None
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class LoadStats:
    requests_sent: int = 0
    requests_completed: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    jobs_started: int = 0
    jobs_finished: int = 0
    jobs_failed: int = 0
    turns_sent: int = 0
    cached_reported: int = 0  # completed requests whose usage reported cached tokens
    cut_at_end: int = 0
    answers_from_server: int = 0  # turns that appended the server's own tokens


@dataclass(slots=True)
class LoadRun:
    """A finished run: its recorder and summary, shaped like the simulator's `SimRun` for
    hybridserve.metrics.plots."""

    config: LoadConfig
    model: str
    recorder: MetricsRecorder
    stats: LoadStats
    summary: dict[str, float]
    sent: list[SentRequest]

    def ttft_samples_s(self) -> list[float]:
        return self.recorder.ttft_samples_s(self.config.warmup_s, self.config.duration_s)

    def itl_samples_s(self) -> list[float]:
        return self.recorder.itl_samples_s(self.config.warmup_s, self.config.duration_s)


class _Driver:
    """The shared part of both workloads: send one request, record it, count failures."""

    def __init__(self, config: LoadConfig, client: httpx.AsyncClient, model: str) -> None:
        self.config = config
        self.client = client
        self.model = model
        self.recorder = MetricsRecorder()
        self.stats = LoadStats()
        self.sent: list[SentRequest] = []
        self.start = time.monotonic()
        limit = config.concurrency_limit
        self._slots = asyncio.Semaphore(limit) if limit is not None else None

    def now(self) -> float:
        return time.monotonic() - self.start

    async def send(
        self, req_id: str, prompt: list[int], max_tokens: int, session_id: str | None
    ) -> Completion:
        if self._slots is None:
            return await self._send(req_id, prompt, max_tokens, session_id)
        async with self._slots:
            return await self._send(req_id, prompt, max_tokens, session_id)

    async def _send(
        self, req_id: str, prompt: list[int], max_tokens: int, session_id: str | None
    ) -> Completion:
        self.sent.append(SentRequest(req_id, session_id, prompt, max_tokens))
        self.stats.requests_sent += 1
        body = completion_body(
            model=self.model,
            prompt=prompt,
            max_tokens=max_tokens,
            session_id=session_id,
            token_ids=self.config.answers == "server",
        )
        self.recorder.on_arrival(req_id, self.now(), len(prompt), session_id)
        try:
            done = await stream_completion(
                self.client, body, headers=request_headers(self.config.api_key, session_id)
            )
        except asyncio.CancelledError:
            self.stats.cut_at_end += 1
            raise
        self._record(req_id, done)
        return done

    def _record(self, req_id: str, done: Completion) -> None:
        if done.failure is not None:
            self.stats.failures[done.failure] += 1
            return
        for t in done.token_times_s:
            self.recorder.on_delivery(req_id, t - self.start, 1)
        record = self.recorder.requests[req_id]
        if done.completion_tokens is not None:
            record.output_tokens = done.completion_tokens
        if done.cached_tokens is not None:
            record.hit_tokens = done.cached_tokens
            self.stats.cached_reported += 1
        end = done.token_times_s[-1] if done.token_times_s else done.done_s or time.monotonic()
        self.recorder.on_finish(req_id, end - self.start)
        self.stats.requests_completed += 1


async def _agent(
    driver: _Driver,
    workload: AgentWorkload,
    agent: int,
    tokens: TokenMap,
    answers: SyntheticAnswers,
) -> None:
    """One agent's jobs, back to back, until cancelled."""
    recorder, stats = driver.recorder, driver.stats
    while True:
        job = workload.new_job(agent)
        recorder.on_job_start(job.job_id, driver.now())
        stats.jobs_started += 1
        failed = await _run_job(driver, workload, job, tokens, answers)
        if failed:
            stats.jobs_failed += 1
        else:
            recorder.on_job_finish(job.job_id, driver.now())
            stats.jobs_finished += 1


async def _run_job(
    driver: _Driver,
    workload: AgentWorkload,
    job: Job,
    tokens: TokenMap,
    answers: SyntheticAnswers,
) -> bool:
    """Send the job's turns; True if any of them failed."""
    mapped: list[int] = []
    failed = False
    while (turn := workload.next_turn(job)) is not None:
        driver.recorder.on_job_turn(job.job_id)
        driver.stats.turns_sent += 1
        prompt = list(tokens.extend(mapped, turn.prompt))
        req_id = f"{turn.job_id}.t{turn.turn}"
        done = await driver.send(req_id, prompt, turn.max_tokens, job.job_id)
        failed = failed or not done.ok
        answer = answers.take(job.agent, turn.max_tokens)
        if driver.config.answers == "server" and done.ok:
            answer = _server_answer(driver, done)
        tool_s = workload.after_answer(job, answer)
        if workload.is_over(job):
            break
        await asyncio.sleep(tool_s * driver.config.time_scale)
    return failed


def _server_answer(driver: _Driver, done: Completion) -> list[int]:
    """The tokens a completed turn generated, as history ids (`--answers server`). Raises
    ConfigError when the server sent none: it does not implement `return_token_ids`."""
    if not done.token_ids_reported:
        raise ConfigError(
            "--answers",
            "server",
            f"{driver.config.url} streamed no token ids (vLLM 0.10.2+ and hybridserve send "
            "them for return_token_ids); use --answers synthetic with this server",
        )
    driver.stats.answers_from_server += 1
    return echoed(done.token_ids)


async def _replay(driver: _Driver, arrivals: Iterable[Arrival], tokens: TokenMap) -> None:
    """Send each trace request at its arrival time (times already scaled), open-loop."""
    pending: set[asyncio.Task[Completion]] = set()
    try:
        for at_s, req_id, prompt, max_tokens in arrivals:
            if at_s >= driver.config.duration_s:
                break
            delay = at_s - driver.now()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.ensure_future(driver.send(req_id, tokens.map(prompt), max_tokens, None))
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.gather(*pending)
    finally:
        for task in pending:
            task.cancel()


async def run_load(
    config: LoadConfig,
    *,
    agents: AgentParams | None = None,
    arrivals: Iterable[Arrival] | None = None,
    progress: Progress | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> LoadRun:
    """Run the agents (or replay `arrivals`) against `config.url` until `config.duration_s`.
    Raises UnreachableServer when the URL does not answer, ConfigError for bad settings."""
    if (agents is None) == (arrivals is None):
        raise ConfigError("workload", None, "give the agents' parameters or a trace's arrivals")
    timeout = httpx.Timeout(config.request_timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=config.url.rstrip("/"), timeout=timeout, limits=limits, transport=transport
    ) as client:
        listed = await served_model(client, url=config.url, api_key=config.api_key)
        model = config.model or listed
        if model is None:
            raise ConfigError(
                "--model", None, f"{config.url}/v1/models lists no model; give its name"
            )
        driver = _Driver(config, client, model)
        if arrivals is not None:
            replay = _replay(driver, arrivals, TokenMap(config.vocab_size))
            tasks = [asyncio.ensure_future(replay)]
        elif agents is not None:
            workload = AgentWorkload(agents, seed=config.seed)
            tokens = TokenMap(config.vocab_size, workload.system_prompt)
            answers = SyntheticAnswers()
            jobs = [_agent(driver, workload, a, tokens, answers) for a in range(agents.num_agents)]
            tasks = [asyncio.ensure_future(job) for job in jobs]
        await _until_end(driver, tasks, progress)
    summary = summarise(driver.recorder, driver.stats, config)
    return LoadRun(config, model, driver.recorder, driver.stats, summary, driver.sent)


async def _until_end(
    driver: _Driver, tasks: list[asyncio.Task[None]], progress: Progress | None
) -> None:
    """Wait until the run's end (or every task is done), reporting progress; cancel the rest."""
    try:
        while (left := driver.config.duration_s - driver.now()) > 0:
            _, running = await asyncio.wait(tasks, timeout=min(left, 0.5))
            if progress is not None:
                progress(driver.now(), driver.stats)
            if not running:
                break
    finally:
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            raise result


def summarise(recorder: MetricsRecorder, stats: LoadStats, config: LoadConfig) -> dict[str, float]:
    """The recorder's summary over the window, plus SLO attainment, cached tokens per turn
    and the run's request counts (whole run, warm-up included)."""
    start, end = config.warmup_s, config.duration_s
    out = recorder.summary(window_start_s=start, window_end_s=end)
    done = recorder.finished_in(start, end)
    met = [r for r in done if meets_slo(r)]  # the simulator's SLO, scored the same way
    out["slo_attainment"] = len(met) / len(done) if done else math.nan
    out.update(slo_goodput(recorder, len(met), start, end))
    out["preemptions"] = math.nan  # a server's preemptions are not visible over HTTP
    out["cached_tokens_per_turn"] = (
        sum(r.hit_tokens for r in done) / len(done) if done else math.nan
    )
    out["prompt_tokens_per_turn"] = (
        sum(r.prompt_tokens for r in done) / len(done) if done else math.nan
    )
    out["requests_sent"] = float(stats.requests_sent)
    out["requests_failed"] = float(sum(stats.failures.values()))
    out["requests_unfinished_at_end"] = float(stats.cut_at_end)
    out["jobs_failed"] = float(stats.jobs_failed)
    out["turns_sent"] = float(stats.turns_sent)
    out["cached_tokens_reported"] = float(stats.cached_reported)
    out["answers_from_server"] = float(stats.answers_from_server)
    return out


def request_rows(run: LoadRun) -> list[dict[str, Any]]:
    """One row per request sent, in sending order: its id, session, prompt and answer lengths,
    the cached prompt tokens the server reported (None for a request that did not finish) and
    its times (seconds since the run began). Two servers on one seed get the same ids for the
    same prompts, so their rows compare turn by turn."""
    rows: list[dict[str, Any]] = []
    for sent in run.sent:
        record = run.recorder.requests.get(sent.req_id)
        finished = record is not None and record.finish_s is not None
        rows.append(
            {
                "id": sent.req_id,
                "session": sent.session_id,
                "prompt_tokens": len(sent.prompt),
                "max_tokens": sent.max_tokens,
                "cached_tokens": record.hit_tokens if finished and record else None,
                "output_tokens": record.output_tokens if finished and record else None,
                "arrival_s": _rounded(record.arrival_s if record else None),
                "first_token_s": _rounded(record.first_token_s if record else None),
                "finish_s": _rounded(record.finish_s if record else None),
            }
        )
    return rows


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


def failures_by_status(stats: LoadStats) -> dict[str, int]:
    return dict(sorted(stats.failures.items()))


def report_json(run: LoadRun) -> dict[str, Any]:
    """The run's metrics (NaN as null), failures by status and its setup."""
    metrics: dict[str, Any] = {
        k: None if math.isnan(v) else round(v, 4) for k, v in run.summary.items()
    }
    metrics["requests_failed_by_status"] = failures_by_status(run.stats)
    return metrics
