"""`agents --answers server`: a job appends the tokens the server generated, as a real agent
does, so the server's cache of its own answer counts; a server that sends no token ids stops
the run with one error naming the option."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from hybridserve.cli import app
from hybridserve.core.errors import ConfigError
from hybridserve.loadgen import run as load_run
from hybridserve.loadgen.client import Completion
from hybridserve.loadgen.run import LoadConfig, LoadRun, run_load
from hybridserve.loadgen.tokens import ECHO_BASE, SyntheticAnswers, TokenMap, echoed
from tests.e2e.conftest import LiveServer
from tests.e2e.test_loadgen import SMALL, recorded_server


@pytest.fixture
def server() -> Iterator[LiveServer]:
    live, _ = recorded_server()
    yield live
    live.stop()


def _run(server: LiveServer, answers: str, *, seed: int = 11) -> LoadRun:
    config = LoadConfig(
        url=server.base_url,
        seed=seed,
        duration_s=3.0,
        warmup_s=0.5,
        time_scale=0.01,
        answers=answers,
    )
    return asyncio.run(run_load(config, agents=SMALL))


def test_echoed_ids_map_back_to_themselves_and_never_meet_a_synthetic_id() -> None:
    tokens = TokenMap(256, system_prompt=range(10))
    assert tokens.map(echoed([0, 5, 255])) == [0, 5, 255]
    drawn = SyntheticAnswers().take(3, 50) + SyntheticAnswers(positive=True).take(3, 50)
    assert all(t > ECHO_BASE for t in drawn) and all(t <= ECHO_BASE for t in echoed([0, 9]))


def test_each_turn_carries_the_tokens_the_server_streamed_for_the_last(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    streamed: dict[tuple[str, int], list[int]] = {}
    stream = load_run.stream_completion

    async def recording(client: httpx.AsyncClient, body: Any, **kw: Any) -> Completion:
        done = await stream(client, body, **kw)
        if done.ok:
            streamed[(body["user"], len(body["prompt"]))] = list(done.token_ids)
        return done

    monkeypatch.setattr(load_run, "stream_completion", recording)
    run = _run(server, "server")
    turns: dict[str | None, list[list[int]]] = defaultdict(list)
    for sent in run.sent:
        turns[sent.session_id].append(sent.prompt)
    checked = 0
    for session, prompts in turns.items():
        for before, after in itertools.pairwise(prompts):
            answer = streamed.get((str(session), len(before)))
            if answer is None:
                continue
            assert after[: len(before)] == before
            assert after[len(before) : len(before) + len(answer)] == answer
            checked += 1
    assert checked >= 10, checked
    assert run.summary["answers_from_server"] >= checked
    assert all(b for b in streamed.values())


def _hits_past_the_last_prompt(run: LoadRun) -> int:
    """Turns whose cached prompt tokens reach past their session's previous prompt: only the
    server's own answer (its cached KV) can give them."""
    last: dict[str | None, int] = {}
    past = 0
    for sent in run.sent:
        record = run.recorder.requests.get(sent.req_id)
        before = last.get(sent.session_id)
        if record is not None and record.finish_s is not None and before is not None:
            past += record.hit_tokens > before
        last[sent.session_id] = len(sent.prompt)
    return past


def test_the_servers_cache_of_its_own_answers_counts(server: LiveServer) -> None:
    fresh, _ = recorded_server()  # a cache of its own: the same seed sends the same prompts
    try:
        synthetic = _run(fresh, "synthetic", seed=12)
    finally:
        fresh.stop()
    own = _run(server, "server", seed=12)
    assert _hits_past_the_last_prompt(synthetic) == 0
    assert _hits_past_the_last_prompt(own) >= 5
    assert synthetic.summary["answers_from_server"] == 0


def _no_ids(request: httpx.Request) -> httpx.Response:
    """A server that streams text but ignores return_token_ids."""
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"data": [{"id": "m"}]})
    body = json.loads(request.content)
    chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
    events = [f"data: {json.dumps(chunk)}\n\n"] * body["max_tokens"] + ["data: [DONE]\n\n"]
    return httpx.Response(200, text="".join(events))


def test_a_server_that_sends_no_token_ids_stops_the_run_naming_the_option() -> None:
    config = LoadConfig(
        url="http://fake", duration_s=2.0, warmup_s=0.5, time_scale=0.01, answers="server"
    )
    with pytest.raises(ConfigError, match=r"--answers.*streamed no token ids"):
        asyncio.run(run_load(config, agents=SMALL, transport=httpx.MockTransport(_no_ids)))


def test_answers_is_checked_and_refused_for_a_trace(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--answers"):
        LoadConfig(url="http://x", answers="echo")
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 8, "output_length": 2}) + "\n")
    result = CliRunner().invoke(
        app,
        [
            "agents",
            "--url",
            "http://127.0.0.1:9",
            "--workload",
            f"mooncake:{trace}",
            "--answers",
            "server",
        ],
    )
    assert result.exit_code != 0 and "--answers" in result.output
