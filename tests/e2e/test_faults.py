"""A failing executor fails the requests of its step, never the server; repeated failures end
the process with a non-zero status so that a supervisor restarts it."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from hybridserve.core.plan import StepPlan, StepResult
from hybridserve.executor.api import Executor
from hybridserve.server.app import ServerSettings
from tests.e2e.conftest import MODEL, LiveServer, start_server, wait_until_serving
from tests.e2e.faulty_backend import FaultyBackend, always_fail

ROOT = Path(__file__).resolve().parents[2]


def _assert_clean(server: LiveServer) -> None:
    server.wait_idle()
    cache = server.state.parts.cache
    with server.state.engine.lock:
        cache.check_invariants()
        assert cache.num_free_blocks == cache.layout.num_blocks - 1


async def _complete(
    http: httpx.AsyncClient, url: str, i: int, *, stream: bool
) -> tuple[int, dict[str, Any]]:
    """(HTTP status, the usage or the error) of request i (half of them streamed)."""
    body = {
        "model": MODEL,
        "prompt": f"request number {i} " * (1 + i % 3),
        "max_tokens": 20 + i % 7,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
        async with http.stream("POST", url, json=body) as response:
            events = [
                json.loads(line[6:])
                async for line in response.aiter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        errors = [e["error"] for e in events if "error" in e]
        if errors:
            return 500, errors[0]
        return response.status_code, events[-1]["usage"]
    response = await http.post(url, json=body)
    payload = response.json()
    return response.status_code, payload.get("usage") or payload["error"]


def test_a_failed_step_fails_its_requests_and_every_other_completes_exactly() -> None:
    def fault(plan: StepPlan, inner: Executor) -> StepResult:
        if plan.step_id == 25:
            backend.failed_plans.append(plan)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return inner.execute(plan)

    backend = FaultyBackend(fault, sim_speed=50.0)
    server = start_server(backend=backend)
    url = server.base_url + "/v1/completions"

    async def run() -> list[tuple[int, dict[str, Any]]]:
        gate = asyncio.Semaphore(16)
        async with httpx.AsyncClient(timeout=60.0) as http:

            async def one(i: int) -> tuple[int, dict[str, Any]]:
                async with gate:
                    return await _complete(http, url, i, stream=i % 2 == 1)

            return await asyncio.gather(*(one(i) for i in range(64)))

    try:
        results = asyncio.run(run())
        failed_step = backend.failed_plans[0]
        assert len(failed_step.chunks) > 1
        failures = [payload for status, payload in results if status == 500]
        assert len(failures) == len(failed_step.chunks)
        assert all(f["code"] == "executor_error" for f in failures)
        assert all("error id err-" in f["message"] for f in failures)
        assert not any("illegal memory access" in f["message"] for f in failures)
        for i, (status, usage) in enumerate(results):
            if status == 200:
                prompt = f"request number {i} " * (1 + i % 3)
                assert usage == {
                    "prompt_tokens": len(prompt.encode()),
                    "completion_tokens": 20 + i % 7,
                    "total_tokens": len(prompt.encode()) + 20 + i % 7,
                    "prompt_tokens_details": {"cached_tokens": 0},
                }
            else:
                assert status == 500
        assert sum(status == 200 for status, _ in results) == 64 - len(failures)
        _assert_clean(server)
        assert server.client.get(server.base_url + "/health").status_code == 200
        assert server.metrics()["hybridserve:engine_failed_steps_total{}"] == 1
        again = server.client.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert again.status_code == 200
    finally:
        server.stop()
    assert server.state.exit_code == 0


def test_consecutive_failed_steps_kill_the_engine_and_stop_the_server_with_status_1() -> None:
    server = start_server(backend=FaultyBackend(always_fail))
    url = server.base_url + "/v1/completions"
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    try:
        first = server.client.post(url, json=body)
        assert first.status_code == 500 and first.json()["error"]["code"] == "executor_error"
        assert "device lost" not in first.json()["error"]["message"]
        # Step 0 failed with the request, step 1 with its finished id; this is the third.
        second = server.client.post(url, json=body)
        assert second.status_code == 500
        server.thread.join(timeout=20)
        assert not server.thread.is_alive()  # the server stopped by itself
        assert server.state.exit_code == 1
        assert "3 failed steps in a row" in (server.state.engine.failure or "")
        cache = server.state.parts.cache
        cache.check_invariants()
        assert cache.num_free_blocks == cache.layout.num_blocks - 1
    finally:
        server.stop()


def test_a_dead_engine_answers_health_with_503() -> None:
    server = start_server(backend=FaultyBackend(always_fail))
    server.state.request_exit = None  # keep serving after the engine died, to ask /health
    url = server.base_url + "/v1/completions"
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    try:
        assert server.client.get(server.base_url + "/health").status_code == 200
        for _ in range(2):  # three failed steps: two requests and one finished-id flush
            assert server.client.post(url, json=body).status_code == 500
        deadline = time.monotonic() + 10
        while not server.state.engine.dead and time.monotonic() < deadline:
            time.sleep(0.02)
        health = server.client.get(server.base_url + "/health")
        assert health.status_code == 503
        assert health.json()["error"]["code"] == "engine_dead"
        refused = server.client.post(url, json=body)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
    finally:
        server.stop()


def test_a_request_the_executor_never_answers_fails_alone_without_a_busy_engine() -> None:
    def fault(plan: StepPlan, inner: Executor) -> StepResult:
        result = inner.execute(plan)
        mute = {c.req_id for c in plan.chunks if 0x21 in c.token_ids}  # a "!" in the prompt
        sampled = {r: t for r, t in result.sampled_token_ids.items() if r not in mute}
        return StepResult(result.step_id, sampled, result.duration_s)

    server = start_server(backend=FaultyBackend(fault))
    url = server.base_url + "/v1/completions"
    try:
        mute = server.client.post(url, json={"model": MODEL, "prompt": "hey!", "max_tokens": 4})
        assert mute.status_code == 500
        assert "returned no token" in mute.json()["error"]["message"]
        fine = server.client.post(url, json={"model": MODEL, "prompt": "hey", "max_tokens": 4})
        assert fine.json()["usage"]["completion_tokens"] == 4
        _assert_clean(server)
        steps = server.state.engine.stats.steps
        time.sleep(0.5)
        assert server.state.engine.stats.steps == steps  # idle: no empty steps spinning
    finally:
        server.stop()


def test_a_token_id_outside_the_vocabulary_fails_only_its_request() -> None:
    def fault(plan: StepPlan, inner: Executor) -> StepResult:
        result = inner.execute(plan)
        wild = {c.req_id for c in plan.chunks if 0x21 in c.token_ids}
        sampled = {r: (100_000,) if r in wild else t for r, t in result.sampled_token_ids.items()}
        return StepResult(result.step_id, sampled, result.duration_s)

    server = start_server(backend=FaultyBackend(fault))
    url = server.base_url + "/v1/completions"

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30.0) as http:
            return await asyncio.gather(
                http.post(url, json={"model": MODEL, "prompt": "go!", "max_tokens": 8}),
                http.post(url, json={"model": MODEL, "prompt": "go", "max_tokens": 8}),
            )

    try:
        wild, tame = asyncio.run(both())
        assert wild.status_code == 500
        assert "token id 100000, outside the vocabulary [0, 257)" in wild.json()["error"]["message"]
        assert tame.status_code == 200 and tame.json()["usage"]["completion_tokens"] == 8
        _assert_clean(server)
        assert server.client.get(server.base_url + "/health").status_code == 200
    finally:
        server.stop()


def test_the_serve_process_exits_non_zero_soon_after_its_executor_keeps_failing() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.faulty_backend"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        base_url = f"http://127.0.0.1:{int(process.stdout.readline())}"
        wait_until_serving(base_url, process, timeout_s=30.0)
        url = base_url + "/v1/completions"
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
        started = time.monotonic()
        for _ in range(2):
            assert httpx.post(url, json=body, timeout=30).status_code == 500
        code = process.wait(timeout=30)
        assert code == 1
        assert time.monotonic() - started < 30
    finally:
        process.kill()
        process.wait()


def test_an_engine_loop_bug_fails_every_request_and_stops_the_server_with_status_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = start_server(sim_speed=0.5)
    url = server.base_url + "/v1/completions"
    try:
        scheduler = server.state.parts.scheduler
        original = scheduler.schedule
        calls = 0

        def schedule(now: float = 0.0) -> Any:
            nonlocal calls
            calls += 1
            if calls == 30:
                raise KeyError("corrupt scheduler state")
            return original(now)

        monkeypatch.setattr(scheduler, "schedule", schedule)
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 500}
        response = server.client.post(url, json=body)
        assert response.status_code == 500
        assert "corrupt" not in response.text and "error id err-" in response.text
        server.thread.join(timeout=20)
        assert not server.thread.is_alive()
        assert server.state.exit_code == 1
        cache = server.state.parts.cache
        cache.check_invariants()
        assert cache.num_free_blocks == cache.layout.num_blocks - 1
    finally:
        server.stop()


class _WarmingBackend(FaultyBackend):
    """Records its warm-up (its thread and tokens), or fails it."""

    def __init__(self, fail: bool) -> None:
        super().__init__(self._count)
        self.fail = fail
        self.steps = 0
        self.warmed: list[tuple[str, int, int]] = []  # (thread, tokens, steps run before)

    def _count(self, plan: StepPlan, inner: Executor) -> StepResult:
        self.steps += 1
        return inner.execute(plan)

    def warm_up(self, num_tokens: int) -> int:
        self.warmed.append((threading.current_thread().name, num_tokens, self.steps))
        if self.fail:
            raise RuntimeError("out of memory in the warm-up")
        return num_tokens


@pytest.mark.parametrize("fail", [False, True])
def test_the_engine_warms_up_on_its_thread_before_its_first_step_and_serves_either_way(
    fail: bool, caplog: pytest.LogCaptureFixture
) -> None:
    backend = _WarmingBackend(fail)
    with caplog.at_level(logging.INFO):
        server = start_server(
            backend=backend,
            settings=ServerSettings(warm_up_tokens=5000),
            max_num_batched_tokens=1024,
        )
        try:
            url = server.base_url + "/v1/completions"
            done = server.client.post(url, json={"model": MODEL, "prompt": "hey", "max_tokens": 3})
            assert done.json()["usage"]["completion_tokens"] == 3
            _assert_clean(server)
        finally:
            server.stop()
    # Once, on the engine thread, at most the token budget.
    assert backend.warmed == [("hybridserve-engine", 1024, 0)]
    if fail:
        assert "the warm-up step failed; serving without it" in caplog.text
    else:
        assert "warm-up: 1024 prompt tokens in one step" in caplog.text


def test_no_warm_up_when_it_is_off() -> None:
    backend = _WarmingBackend(False)
    server = start_server(backend=backend, settings=ServerSettings(warm_up_tokens=0))
    try:
        url = server.base_url + "/v1/completions"
        assert server.client.post(url, json={"model": MODEL, "prompt": "x"}).status_code == 200
    finally:
        server.stop()
    assert backend.warmed == []
