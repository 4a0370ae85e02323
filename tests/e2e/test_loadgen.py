"""The load generator (`hybridserve agents --url`) against `serve --executor sim` in-process:
identical request sequences on one seed, job and turn counts, failures and disconnects counted,
cached tokens read from the usage, and the command's errors and JSON line."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hybridserve.cli import app
from hybridserve.cli.serve_commands import build_app
from hybridserve.core.plan import StepPlan, StepResult
from hybridserve.executor.api import Executor
from hybridserve.loadgen.run import LoadConfig, LoadRun, run_load
from hybridserve.loadgen.tokens import SyntheticAnswers
from hybridserve.server.app import ServerSettings
from hybridserve.sim.arrivals import mooncake_arrivals
from hybridserve.sim.workload import AgentParams, AgentWorkload, LogNormal
from tests.e2e.conftest import LiveServer, free_port, serve_in_thread
from tests.e2e.faulty_backend import FaultyBackend

SMALL = AgentParams(
    num_agents=4,
    system_prompt_tokens=300,
    task_tokens=LogNormal(median=80, sigma=0.5, low=10, high=300),
    turns_per_job=LogNormal(median=4, sigma=0.4, low=2, high=8),
    output_tokens=LogNormal(median=12, sigma=0.6, low=1, high=60),
    tool_result_tokens=LogNormal(median=40, sigma=0.6, low=1, high=200),
    context_limit=3000,
)


@dataclass
class Received:
    """What a server received on /v1/completions and what it streamed back."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    session_headers: list[str | None] = field(default_factory=list)
    cached: dict[str, int] = field(default_factory=dict)  # session + turn -> cached tokens
    dropped: int = 0


class Recording:
    """ASGI middleware: records each completion request and the cached tokens of its usage;
    with `drop_every=N` it cuts every Nth streamed response after its third body chunk, before
    its [DONE] (the
    connection closes mid-stream)."""

    def __init__(self, app: Any, received: Received, drop_every: int | None = None) -> None:
        self.app, self.received, self.drop_every = app, received, drop_every
        self.state = app.state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        received = self.received
        sent = 0

        async def snd(message: Any) -> None:
            nonlocal sent
            every = self.drop_every
            drop = every is not None and index % every == every - 1
            if message["type"] == "http.response.body":
                sent += 1
                body = message.get("body", b"")
                if drop and sent > 3 and body and b"[DONE]" not in body:
                    received.dropped += 1
                    raise RuntimeError("connection cut by the test")
                for line in message.get("body", b"").decode().splitlines():
                    if line.startswith("data: {") and '"usage"' in line:
                        usage = json.loads(line[6:]).get("usage") or {}
                        details = usage.get("prompt_tokens_details") or {}
                        received.cached[key] = details.get("cached_tokens", -1)
            await send(message)

        # Read the body before the app does; a request cut before its body came is not kept.
        message = await receive()
        chunks.append(message.get("body", b""))
        while message.get("more_body"):
            message = await receive()
            chunks.append(message.get("body", b""))
        if message["type"] != "http.request":
            return
        body = json.loads(b"".join(chunks))
        index = len(received.bodies)
        received.bodies.append(body)
        headers = dict(scope["headers"])
        received.session_headers.append((headers.get(b"x-session-id") or b"").decode() or None)
        key = f"{body.get('user')}#{index}"
        replay = iter([{"type": "http.request", "body": b"".join(chunks), "more_body": False}])

        async def replayed() -> Any:
            return next(replay, None) or await receive()

        await self.app(scope, replayed, snd)


def recorded_server(
    backend: Any = None, *, drop_every: int | None = None
) -> tuple[LiveServer, Received]:
    from hybridserve.cli.sim_backend import SimServingBackend

    backend = backend or SimServingBackend(sim_speed=50.0, max_model_len=8192)
    inner = build_app(backend, ServerSettings(shutdown_timeout_s=5.0))
    received = Received()
    wrapped = Recording(inner, received, drop_every)
    return serve_in_thread(wrapped), received


@pytest.fixture
def servers() -> Iterator[list[tuple[LiveServer, Received]]]:
    made: list[tuple[LiveServer, Received]] = []
    yield made
    for server, _ in made:
        server.stop()


def run_agents(server: LiveServer, *, seed: int = 7, duration_s: float = 3.0) -> LoadRun:
    config = LoadConfig(
        url=server.base_url, seed=seed, duration_s=duration_s, warmup_s=0.5, time_scale=0.01
    )
    return asyncio.run(run_load(config, agents=SMALL))


def per_session(received: Received) -> dict[str, list[tuple[tuple[int, ...], int]]]:
    sessions: dict[str, list[tuple[tuple[int, ...], int]]] = defaultdict(list)
    for body in received.bodies:
        sessions[body["user"]].append((tuple(body["prompt"]), body["max_tokens"]))
    return sessions


def common_prefixes(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> tuple[int, bool]:
    """(requests compared, whether every compared pair was equal): each session's turns up
    to the shorter of the two runs."""
    compared, equal = 0, True
    for session in a.keys() & b.keys():
        n = min(len(a[session]), len(b[session]))
        compared += n
        equal = equal and a[session][:n] == b[session][:n]
    return compared, equal


def test_two_servers_on_one_seed_receive_identical_request_sequences(servers: list) -> None:
    for _ in range(3):
        servers.append(recorded_server())
    (one, got_one), (two, got_two), (three, got_three) = servers
    run_agents(one, seed=7)
    run_agents(two, seed=7)
    run_agents(three, seed=8)
    first, second = per_session(got_one), per_session(got_two)
    compared, equal = common_prefixes(first, second)
    assert equal
    assert compared >= 40, compared
    assert len(first.keys() & second.keys()) >= 8  # jobs of every agent, several each
    # The session rides in the header too; and another seed sends other requests.
    assert got_one.session_headers == [b["user"] for b in got_one.bodies]
    other_compared, other_equal = common_prefixes(first, per_session(got_three))
    assert other_compared > 0 and not other_equal
    assert all(b["ignore_eos"] and b["stream"] for b in got_one.bodies)


def expected_turns(seed: int, job_ids: set[str]) -> dict[str, int]:
    """Each job's turn count, by replaying the workload alone (answers of the drawn length)."""
    workload, answers = AgentWorkload(SMALL, seed=seed), SyntheticAnswers()
    wanted: dict[str, int] = {}
    for agent in range(SMALL.num_agents):
        for _ in range(40):
            job = workload.new_job(agent)
            turns = 0
            while (turn := workload.next_turn(job)) is not None:
                turns += 1
                workload.after_answer(job, answers.take(agent, turn.max_tokens))
                if workload.is_over(job):
                    break
            wanted[job.job_id] = turns
    return {job: wanted[job] for job in job_ids}


def test_job_and_turn_counts_follow_the_workload(servers: list) -> None:
    servers.append(recorded_server())
    server, received = servers[0]
    run = run_agents(server, seed=3)
    recorder = run.recorder
    finished = {j.job_id: j.turns for j in recorder.jobs.values() if j.finish_s is not None}
    assert len(finished) >= 8
    assert finished == expected_turns(3, set(finished))
    assert run.stats.jobs_finished == len(finished)
    sent, cut = run.stats.requests_sent, run.stats.cut_at_end
    assert sent == run.summary["requests_sent"]
    assert sent - cut <= len(received.bodies) <= sent  # a request cut at the end may not arrive
    assert run.stats.turns_sent == sum(j.turns for j in recorder.jobs.values())
    sessions = per_session(received)
    assert all(len(sessions[job]) == turns for job, turns in finished.items())
    assert run.summary["requests_failed"] == 0
    assert run.summary["jobs_completed"] > 0 and run.summary["job_goodput_per_hour"] > 0


class FailTenth:
    """Fails the request of every tenth new request id (a token outside the vocabulary: that
    request alone fails), and remembers which."""

    def __init__(self) -> None:
        self.failed: set[str] = set()
        self._seen: list[str] = []

    def __call__(self, plan: StepPlan, inner: Executor) -> StepResult:
        result = inner.execute(plan)
        for chunk in plan.chunks:
            if chunk.new_request and chunk.req_id not in self._seen:
                self._seen.append(chunk.req_id)
                if len(self._seen) % 10 == 0:
                    self.failed.add(chunk.req_id)
        sampled = {
            r: (10**6,) if r in self.failed else ids for r, ids in result.sampled_token_ids.items()
        }
        return StepResult(result.step_id, sampled, result.duration_s, result.draft_token_ids)


def test_a_server_failing_a_tenth_of_requests_is_counted_by_status(servers: list) -> None:
    fault = FailTenth()
    servers.append(recorded_server(FaultyBackend(fault, sim_speed=50.0, max_model_len=8192)))
    server, _ = servers[0]
    run = run_agents(server, seed=5)
    failed = run.summary["requests_failed"]
    # Every request the server failed is counted (one may race the run's end and be cut).
    assert len(fault.failed) - run.stats.cut_at_end <= failed <= len(fault.failed)
    assert failed > 0
    assert 0.05 <= failed / run.summary["requests_sent"] <= 0.15
    statuses = run.stats.failures
    assert set(statuses) == {"stream:executor_error"}, statuses
    assert run.summary["requests_completed"] > 0
    # A job with a failed turn is not a completed job; the agents kept going.
    assert run.stats.jobs_failed > 0
    assert run.stats.jobs_finished + run.stats.jobs_failed <= run.stats.jobs_started


def test_a_disconnect_mid_stream_is_counted_not_fatal(servers: list) -> None:
    servers.append(recorded_server(drop_every=7))
    server, received = servers[0]
    run = run_agents(server, seed=2)
    assert received.dropped > 0
    assert set(run.stats.failures) == {"disconnect"}
    counted = run.stats.failures["disconnect"]  # one cut may race the run's end
    assert received.dropped - run.stats.cut_at_end <= counted <= received.dropped
    assert run.summary["requests_completed"] > 3 * received.dropped
    assert len(received.bodies) <= run.stats.requests_sent


def test_cached_tokens_come_from_the_usage(servers: list) -> None:
    servers.append(recorded_server())
    server, received = servers[0]
    run = run_agents(server, seed=4, duration_s=2.5)
    by_session_turn = {}
    for index, body in enumerate(received.bodies):
        key = f"{body['user']}#{index}"
        if key in received.cached:
            by_session_turn[(body["user"], tuple(body["prompt"]))] = received.cached[key]
    recorded = {
        (r.job_id, tuple(s.prompt)): r.hit_tokens
        for r, s in zip(run.recorder.requests.values(), run.sent, strict=True)
        if r.finish_s is not None
    }
    assert recorded and all(recorded[k] == by_session_turn[k] for k in recorded)
    assert any(v > 0 for v in recorded.values())
    assert run.summary["prefix_hit_rate"] > 0
    assert run.stats.cached_reported == run.stats.requests_completed


def test_an_unreachable_url_is_one_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(app, ["agents", "--url", url, "--duration", "2", "--warmup", "1"])
    assert result.exit_code == 2
    assert "--url" in result.output and url in result.output
    assert "Traceback" not in result.output


def test_agents_json_prints_the_interface_keys_on_its_last_line(servers: list) -> None:
    servers.append(recorded_server())
    server, _ = servers[0]
    args = [
        "agents", "--url", server.base_url, "--agents", "3", "--duration", "2.5",
        "--warmup", "0.5", "--seed", "1", "--time-scale", "0.01",
        "--system-prompt-tokens", "200", "--max-context", "2500", "--output-tokens", "10",
        "--tool-result-tokens", "30", "--json",
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    for key in (
        "job_goodput_per_hour", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms",
        "itl_p50_ms", "itl_p99_ms", "prefix_hit_rate", "requests_failed", "requests_sent",
    ):  # fmt: skip
        assert isinstance(payload[key], int | float), key
    assert payload["requests_sent"] > 0 and payload["requests_failed"] == 0


def test_a_mooncake_trace_is_replayed_at_its_arrival_times(servers: list, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 250 * i, "input_length": 600, "output_length": 4, "hash_ids": [1, 2 + i]}
        for i in range(6)
    ]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    from hybridserve.cli.sim_backend import SimServingBackend

    # Full attention only: a hit may end at any block (a hybrid's only at a kept state).
    backend = SimServingBackend(model_profile="llama-3.1-8b", sim_speed=50.0, max_model_len=8192)
    servers.append(recorded_server(backend))
    server, received = servers[0]
    config = LoadConfig(url=server.base_url, duration_s=2.0, warmup_s=0.0)
    arrivals = list(mooncake_arrivals(trace))
    run = asyncio.run(run_load(config, arrivals=arrivals))
    assert len(received.bodies) == run.stats.requests_sent == 6
    sent_at = [r.arrival_s for r in run.recorder.requests.values()]
    assert all(abs(at - 0.25 * i) < 0.1 for i, at in enumerate(sent_at)), sent_at
    assert run.stats.requests_completed == 6 and not run.stats.failures
    # The trace's shared first block (hash id 1) is a prefix every later request hits.
    assert all(r.hit_tokens > 0 for r in list(run.recorder.requests.values())[1:])


def test_agents_out_writes_one_row_per_request_with_its_cached_tokens(
    servers: list, tmp_path: Path
) -> None:
    servers.append(recorded_server())
    server, received = servers[0]
    args = [
        "agents", "--url", server.base_url, "--agents", "3", "--duration", "2.5",
        "--warmup", "0.5", "--seed", "1", "--time-scale", "0.01",
        "--system-prompt-tokens", "200", "--max-context", "2500", "--output-tokens", "10",
        "--tool-result-tokens", "30", "--out", str(tmp_path), "--json",
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(rows) == payload["requests_sent"] >= len(received.bodies)  # cut ones may not
    sent = [(r["session"], r["prompt_tokens"], r["max_tokens"]) for r in rows]
    assert {(b["user"], len(b["prompt"]), b["max_tokens"]) for b in received.bodies} <= set(sent)
    served = {
        f"{body['user']}#{len(body['prompt'])}": received.cached[f"{body['user']}#{index}"]
        for index, body in enumerate(received.bodies)
        if f"{body['user']}#{index}" in received.cached
    }
    finished = [r for r in rows if r["finish_s"] is not None]
    assert finished and all(
        r["cached_tokens"] == served[f"{r['session']}#{r['prompt_tokens']}"] for r in finished
    )
    assert any(r["cached_tokens"] for r in finished)
    assert all(r["cached_tokens"] is None for r in rows if r["finish_s"] is None)
