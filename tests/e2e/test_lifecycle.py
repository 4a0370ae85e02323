"""Back-pressure, non-streaming disconnects and graceful shutdown leave the cache clean."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from hybridserve.server.app import ServerSettings
from tests.e2e.conftest import MODEL, LiveServer, start_server, wait_until_serving


def _body(max_tokens: int, *, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": "tell a long story",
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def _first_token(lines: AsyncIterator[str]) -> None:
    """Read up to the first generated text. The caller keeps `lines`: dropping a half-read
    iterator closes the connection."""
    while True:
        line = await anext(lines)
        if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
            return


def _wait_for(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def _assert_clean(server: LiveServer) -> None:
    scheduler, cache = server.state.parts.scheduler, server.state.parts.cache
    with server.state.engine.lock:
        assert not scheduler.requests
        cache.check_invariants()
        assert cache.num_free_blocks == cache.layout.num_blocks - 1


def test_full_waiting_queue_answers_503_with_retry_after() -> None:
    server = start_server(
        settings=ServerSettings(max_waiting=2, retry_after_s=3), sim_speed=0.5, max_num_seqs=1
    )
    url = server.base_url + "/v1/completions"

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(timeout=30.0) as http:
            running = await http.send(
                http.build_request("POST", url, json=_body(3000, stream=True)), stream=True
            )
            lines = running.aiter_lines()
            await _first_token(lines)
            queued = [
                await http.send(
                    http.build_request("POST", url, json=_body(10, stream=True)), stream=True
                )
                for _ in range(2)
            ]
            await asyncio.to_thread(_wait_for, lambda: server.state.engine.num_queued() == 2)
            rejected = await http.post(url, json=_body(10, stream=False))
            for response in (running, *queued):
                await response.aclose()  # hang up: the running and the waiting requests abort
            return rejected

    try:
        rejected = asyncio.run(scenario())
        assert rejected.status_code == 503
        assert rejected.headers["retry-after"] == "3"
        assert rejected.json()["error"]["code"] == "queue_full"
        server.wait_idle()
        _assert_clean(server)
        metrics = server.metrics()
        assert metrics["hybridserve:request_success_total{finished_reason=abort}"] == 3
    finally:
        server.stop()


def test_client_hanging_up_on_a_whole_response_aborts_it() -> None:
    server = start_server(sim_speed=0.5)
    try:

        async def scenario() -> None:
            async with httpx.AsyncClient(timeout=30.0) as http:
                task = asyncio.create_task(
                    http.post(server.base_url + "/v1/completions", json=_body(3000, stream=False))
                )
                scheduler = server.state.parts.scheduler
                await asyncio.to_thread(_wait_for, lambda: len(scheduler.running) == 1)
                task.cancel()  # closes the connection before any response byte

        asyncio.run(scenario())
        server.wait_idle()
        _assert_clean(server)
        metrics = server.metrics()
        assert metrics["hybridserve:request_success_total{finished_reason=abort}"] == 1
    finally:
        server.stop()


def test_shutdown_finishes_short_requests_and_aborts_the_rest() -> None:
    server = start_server(sim_speed=0.5, shutdown_timeout_s=1)
    results: dict[str, Any] = {}

    def long_stream() -> None:
        try:
            with (
                httpx.Client(timeout=30.0) as http,
                http.stream(
                    "POST", server.base_url + "/v1/completions", json=_body(3000, stream=True)
                ) as r,
            ):
                results["long"] = sum(1 for _ in r.iter_lines())
        except httpx.HTTPError as exc:
            results["long"] = exc

    thread = threading.Thread(target=long_stream)
    thread.start()
    scheduler = server.state.parts.scheduler
    _wait_for(lambda: len(scheduler.running) == 1)
    short = threading.Thread(
        target=lambda: results.setdefault(
            "short",
            httpx.post(
                server.base_url + "/v1/completions", json=_body(4, stream=False), timeout=30
            ),
        )
    )
    short.start()
    _wait_for(lambda: len(scheduler.running) == 2 or "short" in results)
    server.stop()
    thread.join(timeout=30)
    short.join(timeout=30)
    assert results["short"].status_code == 200
    assert results["short"].json()["choices"][0]["finish_reason"] == "length"
    assert isinstance(results["long"], int)  # the stream ended instead of hanging
    assert not server.state.engine.running
    assert server.state.exit_code == 0
    _assert_clean(server)


def _data_lines(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_shutdown_refuses_new_requests_aborts_queued_ones_and_cuts_running_ones() -> None:
    server = start_server(sim_speed=0.5, shutdown_timeout_s=3, max_num_seqs=2)
    url = server.base_url + "/v1/completions"
    results: dict[str, tuple[Any, float]] = {}

    def stream(name: str) -> None:
        with (
            httpx.Client(timeout=60.0) as http,
            http.stream("POST", url, json=_body(3000, stream=True)) as r,
        ):
            results[name] = (_data_lines(r), time.monotonic())

    def whole(name: str) -> None:
        results[name] = (
            httpx.post(url, json=_body(3000, stream=False), timeout=60),
            time.monotonic(),
        )

    def start(target: Any, name: str) -> threading.Thread:
        thread = threading.Thread(target=target, args=(name,))
        thread.start()
        return thread

    scheduler = server.state.parts.scheduler
    clients = [start(stream, "running stream"), start(whole, "running whole")]
    _wait_for(lambda: len(scheduler.running) == 2)
    clients += [start(stream, "queued stream"), start(whole, "queued whole")]
    _wait_for(lambda: server.state.engine.num_queued() == 2)
    began = time.monotonic()
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    _wait_for(lambda: server.state.draining)
    late = httpx.post(url, json=_body(4, stream=False), timeout=10)
    health = httpx.get(server.base_url + "/health", timeout=10)
    for client in clients:
        client.join(timeout=30)
    stopper.join(timeout=30)

    for refused in (late, health):
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "shutdown"
    queued, answered_at = results["queued whole"]
    assert queued.status_code == 503 and queued.json()["error"]["code"] == "shutdown"
    assert answered_at - began < 1.5  # at once, not after the grace period
    lines, _ = results["queued stream"]
    assert json.loads(lines[-2])["error"]["code"] == "shutdown" and lines[-1] == "[DONE]"
    lines, ended_at = results["running stream"]
    assert ended_at - began > 2.5  # the running requests had the whole grace period
    assert json.loads(lines[-2])["choices"][0]["finish_reason"] == "abort"
    assert lines[-1] == "[DONE]"
    cut, _ = results["running whole"]
    assert cut.status_code == 503
    assert set(cut.json()["error"]) == {"message", "type", "param", "code"}
    assert "shut down before this request finished" in cut.json()["error"]["message"]
    assert server.state.exit_code == 0
    _assert_clean(server)


def test_streaming_and_whole_requests_share_the_waiting_queue_limit() -> None:
    server = start_server(settings=ServerSettings(max_waiting=4), sim_speed=0.5, max_num_seqs=1)
    url = server.base_url + "/v1/completions"

    async def burst() -> tuple[list[httpx.Response], int, httpx.Response]:
        async with httpx.AsyncClient(timeout=30.0) as http:
            requests = [
                http.build_request("POST", url, json=_body(3000, stream=True)) for _ in range(40)
            ]
            responses = await asyncio.gather(*(http.send(r, stream=True) for r in requests))
            peak = server.state.engine.num_queued()
            whole = await http.post(url, json=_body(4, stream=False))
            for response in responses:
                await response.aclose()
            return list(responses), peak, whole

    try:
        responses, peak, whole = asyncio.run(burst())
        accepted = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code == 503]
        assert peak <= 4
        assert 1 <= len(accepted) <= 5  # one running plus at most four waiting
        assert len(accepted) + len(refused) == 40
        assert all(r.headers["retry-after"] == "1" for r in refused)
        assert whole.status_code == 503 and whole.json()["error"]["code"] == "queue_full"
        server.wait_idle()
        _assert_clean(server)
    finally:
        server.stop()


def test_a_client_hanging_up_mid_upload_logs_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    server = start_server()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(handler)
    try:
        with caplog.at_level(logging.INFO):
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n"
                    b'{"model": "'
                )
                time.sleep(0.2)
            _wait_for(lambda: any("disconnected" in r.getMessage() for r in caplog.records))
            time.sleep(0.2)
        logged = [*records, *caplog.records]
        assert not [r for r in logged if r.exc_info or "Traceback" in r.getMessage()]
        assert not [r for r in logged if r.levelno >= logging.ERROR]
        server.wait_idle()
        _assert_clean(server)
    finally:
        uvicorn_log.removeHandler(handler)
        server.stop()


def test_requests_preempted_for_lack_of_blocks_still_deliver_every_token() -> None:
    # 15 usable blocks of 544 tokens (full attention and three Mamba groups) for 8 requests
    server = start_server(num_blocks=16)

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60.0) as http:
            url = server.base_url + "/v1/completions"
            return await asyncio.gather(
                *(
                    http.post(url, json={**_body(700, stream=False), "prompt": f"req {i} " * 20})
                    for i in range(8)
                )
            )

    try:
        responses = asyncio.run(scenario())
        assert [r.json()["usage"]["completion_tokens"] for r in responses] == [700] * 8
        assert all(len(r.json()["choices"][0]["text"]) == 700 for r in responses)
        server.wait_idle()
        assert server.metrics()["hybridserve:num_preemptions_total{}"] > 0
        _assert_clean(server)
    finally:
        server.stop()


def test_sigint_drains_the_serve_process_and_exits_0() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "hybridserve.cli", "serve", "--executor", "sim"]
    command += ["--port", str(port), "--sim-speed", "0.5", "--shutdown-timeout", "1"]
    command += ["--sim-eos-probability", "0"]  # the answer must still run at SIGINT
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(base_url, process)
        body = {**_body(3000, stream=True), "model": "qwen3-next-80b-a3b"}
        with (
            httpx.Client(timeout=30.0) as http,
            http.stream("POST", base_url + "/v1/completions", json=body) as response,
        ):
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            process.send_signal(signal.SIGINT)
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
        assert rest[-1] == "[DONE]"
        assert process.wait(timeout=30) == 0
        assert process.stderr is not None
        stderr = process.stderr.read()
        assert "Traceback" not in stderr
        # Said at the first signal, not after the drain.
        waiting = "shutting down: waiting up to 1 s for 1 running request; Ctrl-C again to stop now"
        assert waiting in stderr
    finally:
        process.kill()
        process.wait()
