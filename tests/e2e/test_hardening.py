"""Serving hardening through the HTTP API: cached-token usage, sessions scoped and bounded per
tenant, the step watchdog and snapshot metrics, queue limits, the published schema, strict
booleans and idle pin expiry."""

from __future__ import annotations

import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from hybridserve.cli.serve_commands import build_app, startup_banner
from hybridserve.core.plan import StepPlan, StepResult
from hybridserve.core.request import Request, SamplingParams
from hybridserve.executor.api import Executor
from hybridserve.server.app import ServerSettings
from hybridserve.server.protocol import MAX_USER_CHARS
from tests.e2e.conftest import (
    MODEL,
    LiveServer,
    free_port,
    serve_in_thread,
    start_server,
    wait_until_serving,
)
from tests.e2e.faulty_backend import FaultyBackend

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PINNED = {"kv_pin_fraction": 0.5, "kv_pin_exact_tail": True}


@pytest.fixture(scope="module")
def pinned_server() -> Iterator[LiveServer]:
    server = start_server(**PINNED)
    yield server
    server.stop()


def _complete(server: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return server.client.post(server.base_url + COMPLETIONS, json={"model": MODEL, **body})


def _turn(server: LiveServer, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True, **extra}
    response = _complete(server, body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def _cached(result: dict[str, Any]) -> int:
    cached: int = result["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 250 + 1 for i in range(length)]


# ----- cached tokens in usage ------------------------------------------------------------------


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(
    pinned_server: LiveServer,
) -> None:
    prompt = _prompt(1, 3000)
    first = _turn(pinned_server, prompt)
    again = _turn(pinned_server, prompt)
    assert _cached(first) == 0
    # The whole prompt but the last token can be served (the last is recomputed for logits).
    assert 0 < _cached(again) < len(prompt)
    assert again["usage"]["prompt_tokens"] == len(prompt)


def test_a_streamed_usage_chunk_reports_cached_tokens(pinned_server: LiveServer) -> None:
    prompt = _prompt(2, 2500)
    _turn(pinned_server, prompt)
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    url = pinned_server.base_url + COMPLETIONS
    with pinned_server.client.stream("POST", url, json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    usage = httpx.Response(200, content=lines[-1].removeprefix("data: ")).json()["usage"]
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] < len(prompt)


# ----- sessions: per tenant, bounded --------------------------------------------------------


def test_a_session_key_has_one_size_whatever_the_session_id() -> None:
    sampling = SamplingParams(max_tokens=1)
    short = Request(req_id="a", prompt_token_ids=(1,), sampling=sampling, session_id="u")
    long = Request(req_id="b", prompt_token_ids=(1,), sampling=sampling, session_id="u" * 10**6)
    assert short.session_key is not None and long.session_key is not None
    assert len(short.session_key) == len(long.session_key) == 32


def test_one_session_name_in_two_tenants_gives_two_sessions() -> None:
    sampling = SamplingParams(max_tokens=1)

    def key(salt: str | None) -> str | None:
        request = Request(
            req_id="r", prompt_token_ids=(1,), sampling=sampling, session_id="u", cache_salt=salt
        )
        return request.session_key

    assert len({key(None), key("tenant-a"), key("tenant-b")}) == 3


def test_another_tenants_request_with_the_same_user_leaves_the_first_tenants_pin(
    pinned_server: LiveServer,
) -> None:
    prompt = _prompt(3, 3400)
    first = _turn(pinned_server, prompt, user="agent-1", cache_salt="tenant-a")
    # Tenant b reuses the session name: it must not take over (and release) tenant a's pin.
    _turn(pinned_server, _prompt(4, 600), user="agent-1", cache_salt="tenant-b")
    turn_end = [*prompt, *first["choices"][0]["text"].encode()]
    second = _turn(
        pinned_server, [*turn_end, *_prompt(5, 40)], user="agent-1", cache_salt="tenant-a"
    )
    # The exact tail resumes where the first turn ended (its last output token excepted: it
    # was sampled, never computed).
    assert _cached(second) == len(turn_end) - 1


def test_a_user_longer_than_the_limit_is_refused_naming_the_field(
    pinned_server: LiveServer,
) -> None:
    response = _complete(pinned_server, {"prompt": "hi", "user": "u" * (MAX_USER_CHARS + 1)})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "user"


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _send_sessions(base_url: str, count: int) -> None:
    def send(client: httpx.Client) -> None:
        user = secrets.token_hex(MAX_USER_CHARS // 2)  # distinct, of the maximum length
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 1, "user": user}
        assert client.post(COMPLETIONS, json=body).status_code == 200

    with httpx.Client(base_url=base_url, timeout=30) as client, ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: send(client), range(count)))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_a_thousand_sessions_of_maximum_length_grow_the_server_by_under_20_mib() -> None:
    port = free_port()
    command = [sys.executable, "-m", "hybridserve.cli", "serve", "--executor", "sim"]
    command += ["--port", str(port), "--sim-speed", "1000"]  # the default preset: pinning on
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(base_url, process)
        _send_sessions(base_url, 200)  # warm up allocators and caches
        before = _rss_bytes(process.pid)
        _send_sessions(base_url, 1000)
        grown = _rss_bytes(process.pid) - before
        assert grown < 20 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB"
    finally:
        process.terminate()
        process.communicate(timeout=30)


# ----- the watchdog and snapshot metrics ------------------------------------------------------


def test_a_hung_step_kills_the_engine_while_metrics_and_health_still_answer() -> None:
    release = threading.Event()
    hung = threading.Event()

    def hang(plan: StepPlan, inner: Executor) -> StepResult:
        hung.set()
        release.wait(30)
        return inner.execute(plan)

    backend = FaultyBackend(hang, max_model_len=4096)
    app = build_app(backend, ServerSettings(step_timeout_s=0.5))
    server = serve_in_thread(app)
    try:
        client = httpx.Client(base_url=server.base_url, timeout=10)
        answer: dict[str, Any] = {}

        def post() -> None:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
            answer["response"] = client.post(COMPLETIONS, json=body)

        sender = threading.Thread(target=post)
        sender.start()
        assert hung.wait(10)
        started = time.monotonic()
        assert client.get("/metrics").status_code == 200  # no engine lock: answers at once
        assert time.monotonic() - started < 0.4
        deadline = time.monotonic() + 5
        while True:  # /health answers 503 from the watchdog's firing until the server exits
            try:
                health = client.get("/health")
            except httpx.TransportError:
                break
            if health.status_code != 200:
                assert health.status_code == 503
                assert "step deadline" in health.json()["error"]["message"]
                break
            assert time.monotonic() < deadline, "the watchdog never fired"
            time.sleep(0.02)
        assert "step deadline" in (server.state.engine.failure or "")
        sender.join(10)
        assert answer["response"].status_code == 500
        server.thread.join(30)
        assert not server.thread.is_alive()
        assert server.state.exit_code == 1
    finally:
        release.set()
        server.client.close()


def test_steps_far_shorter_than_the_deadline_never_trip_the_watchdog() -> None:
    server = start_server(settings=ServerSettings(step_timeout_s=2.0))
    try:
        for _ in range(3):
            assert _complete(server, {"prompt": "x" * 200, "max_tokens": 32}).status_code == 200
        assert server.client.get(server.base_url + "/health").status_code == 200
    finally:
        server.stop()


def test_the_watchdog_deadline_is_a_server_setting_with_a_long_default() -> None:
    assert ServerSettings().step_timeout_s >= 300


# ----- the published schema -----------------------------------------------------------------


def test_openapi_publishes_the_request_models_and_the_error_model(live_server: LiveServer) -> None:
    document = live_server.client.get(live_server.base_url + "/openapi.json").json()
    schemas = document["components"]["schemas"]
    for path, model in ((COMPLETIONS, "CompletionRequest"), (CHAT, "ChatCompletionRequest")):
        operation = document["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert {"model", "max_tokens"} <= set(schemas[model]["properties"])
        error = operation["responses"]["400"]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert set(schemas["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]


# ----- small things ---------------------------------------------------------------------------


def test_posting_to_a_get_route_is_405_not_415(live_server: LiveServer) -> None:
    response = live_server.client.post(live_server.base_url + "/v1/models", content=b"x")
    assert response.status_code == 405


@pytest.mark.parametrize(
    ("field", "value"), [("use_beam_search", 0), ("skip_special_tokens", 1), ("ignore_eos", 0)]
)
def test_a_boolean_field_refuses_an_integer(
    live_server: LiveServer, field: str, value: int
) -> None:
    response = _complete(live_server, {"prompt": "hi", "max_tokens": 1, field: value})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field


def test_an_idle_server_releases_expired_pins_without_any_request() -> None:
    server = start_server(kv_pin_fraction=0.5, kv_pin_max_ttl_s=0.3)
    try:
        assert _turn(server, _prompt(6, 3000), user="idle-agent")["usage"]
        metrics = server.metrics()
        assert metrics["hybridserve:kv_pinned_blocks{}"] > 0
        time.sleep(0.8)  # no traffic: only the idle engine's own wake-up can release it
        metrics = server.metrics()
        assert metrics["hybridserve:kv_pinned_blocks{}"] == 0
        assert metrics["hybridserve:kv_pins_released_on_ttl_total{}"] == 1
    finally:
        server.stop()


def test_the_banners_curl_line_sends_the_key_when_the_server_has_one() -> None:
    server = start_server(settings=ServerSettings(api_key="secret"))
    try:
        banner = startup_banner(server.state, host="127.0.0.1", port=server.port)
        (curl,) = [line for line in banner.splitlines() if "curl" in line]
        assert "Authorization: Bearer $HYBRIDSERVE_API_KEY" in curl
        assert "secret" not in banner
    finally:
        server.stop()
