"""Back-pressure, non-streaming disconnects and graceful shutdown leave the cache clean."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from hybridserve.server.app import ServerSettings
from tests.e2e.conftest import MODEL, LiveServer, start_server


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
    assert "long" in results  # the stream ended instead of hanging
    assert not server.state.engine.running
    _assert_clean(server)


def test_requests_preempted_for_lack_of_blocks_still_deliver_every_token() -> None:
    server = start_server(num_blocks=8)  # 7 usable blocks of 544 tokens for 8 requests

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
