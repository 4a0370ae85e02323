"""A chat request that sets no max_tokens is bounded by the server's default, and the sim
backend ends answers with <eos> at its configured rate."""

from __future__ import annotations

from hybridserve.cli.serve_commands import build_app
from hybridserve.cli.sim_backend import SimServingBackend
from hybridserve.server.app import ServerSettings
from tests.e2e.conftest import MODEL, serve_in_thread, start_server

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}


def test_chat_without_max_tokens_stops_at_the_default_max_tokens() -> None:
    server = start_server(settings=ServerSettings(default_max_tokens=24))
    try:
        reply = server.client.post(f"{server.api_url}/chat/completions", json=CHAT).json()
    finally:
        server.stop()
    assert reply["usage"]["completion_tokens"] == 24
    assert reply["choices"][0]["finish_reason"] == "length"


def test_sim_answers_end_with_eos_unless_ignore_eos() -> None:
    backend = SimServingBackend(sim_speed=1000.0, max_model_len=4096, eos_probability=0.2)
    server = serve_in_thread(build_app(backend, ServerSettings()))
    try:
        body = {**CHAT, "max_tokens": 400}
        url = f"{server.api_url}/chat/completions"
        replies = [server.client.post(url, json=body).json() for _ in range(6)]
        ignored = server.client.post(url, json={**body, "ignore_eos": True}).json()
    finally:
        server.stop()
    lengths = [r["usage"]["completion_tokens"] for r in replies]
    assert all(r["choices"][0]["finish_reason"] == "stop" for r in replies), lengths
    assert max(lengths) < 100  # geometric, mean 5 tokens
    assert ignored["usage"]["completion_tokens"] == 400
