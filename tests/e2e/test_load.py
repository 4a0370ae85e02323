"""200 concurrent streams on loopback, a third of the clients hanging up mid-stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import MODEL, LiveServer, start_server

NUM_CLIENTS = 200
MAX_TOKENS = 40
MAX_MODEL_LEN = 8192
# Clients that hang up ask for nearly all the room the model has, far more than they read.
# At SIM_SPEED a lone request takes about 16 s of wall time to produce 8,000 tokens, while the
# server sees a hang-up well within a second, so every hang-up must end in an abort however
# loaded the machine is.
HANG_UP_MAX_TOKENS = 8000
SIM_SPEED = 2.0
ALLOWED_LABELS = {"model_name", "finished_reason", "group", "kind", "le"}


@dataclass
class Outcome:
    disconnected: bool
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None


async def _stream_one(http: httpx.AsyncClient, url: str, index: int, hang_up: bool) -> Outcome:
    body = {
        "model": MODEL,
        "prompt": f"client {index}: summarise the build log, step {index % 17}.",
        "max_tokens": HANG_UP_MAX_TOKENS if hang_up else MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    outcome = Outcome(disconnected=hang_up)
    async with http.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                outcome.text += chunk["choices"][0]["text"]
                outcome.finish_reason = chunk["choices"][0]["finish_reason"]
            if chunk.get("usage"):
                outcome.completion_tokens = chunk["usage"]["completion_tokens"]
            if hang_up and len(outcome.text) >= 3:
                break  # leaving the block closes the connection mid-stream
    return outcome


async def _run_clients(base_url: str) -> list[Outcome]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 10)
    async with httpx.AsyncClient(limits=limits, timeout=60.0) as http:
        url = f"{base_url}/v1/completions"
        return await asyncio.gather(
            *(_stream_one(http, url, i, hang_up=i % 3 == 0) for i in range(NUM_CLIENTS))
        )


@pytest.fixture(scope="module")
def loaded_server() -> Iterator[tuple[LiveServer, list[Outcome]]]:
    server = start_server(sim_speed=SIM_SPEED, max_model_len=MAX_MODEL_LEN)
    outcomes = asyncio.run(_run_clients(server.base_url))
    server.wait_idle()
    yield server, outcomes
    server.stop()


def test_every_client_that_stayed_gets_its_complete_output(
    loaded_server: tuple[LiveServer, list[Outcome]],
) -> None:
    _, outcomes = loaded_server
    stayed = [o for o in outcomes if not o.disconnected]
    assert len(stayed) == NUM_CLIENTS - len(range(0, NUM_CLIENTS, 3))
    for outcome in stayed:
        assert outcome.finish_reason == "length"
        assert len(outcome.text) == MAX_TOKENS
        assert outcome.completion_tokens == MAX_TOKENS


def test_hung_up_streams_are_aborted_and_free_every_block(
    loaded_server: tuple[LiveServer, list[Outcome]],
) -> None:
    server, outcomes = loaded_server
    scheduler, cache = server.state.parts.scheduler, server.state.parts.cache
    with server.state.engine.lock:
        assert not scheduler.requests and not scheduler.running
        cache.check_invariants()
        assert cache.num_free_blocks == cache.layout.num_blocks - 1
    metrics = server.metrics()
    assert metrics["hybridserve:num_requests_running{}"] == 0
    assert metrics["hybridserve:kv_cache_usage_perc{}"] == 0
    finished = {
        reason: metrics[f"hybridserve:request_success_total{{finished_reason={reason}}}"]
        for reason in ("stop", "length", "abort")
    }
    hung_up = sum(o.disconnected for o in outcomes)
    assert sum(finished.values()) == NUM_CLIENTS
    assert finished["length"] == NUM_CLIENTS - hung_up
    assert finished["abort"] == hung_up


def test_metrics_parse_with_bounded_label_cardinality(
    loaded_server: tuple[LiveServer, list[Outcome]],
) -> None:
    server, _ = loaded_server
    text = server.client.get(server.base_url + "/metrics").text
    families = list(text_string_to_metric_families(text))
    names = {f.name for f in families}
    for expected in (
        "hybridserve:num_requests_running",
        "hybridserve:num_requests_waiting",
        "hybridserve:kv_cache_usage_perc",
        "hybridserve:prefix_cache_queries",
        "hybridserve:prefix_cache_hits",
        "hybridserve:num_preemptions",
        "hybridserve:prompt_tokens",
        "hybridserve:generation_tokens",
        "hybridserve:request_success",
        "hybridserve:time_to_first_token_seconds",
        "hybridserve:inter_token_latency_seconds",
        "hybridserve:e2e_request_latency_seconds",
        "hybridserve:request_queue_time_seconds",
        "hybridserve:hybrid_group_hit_tokens",
        "hybridserve:scheduler_governed_prefill_tokens",
    ):
        assert expected in names, expected
    for family in families:
        if not family.name.startswith("hybridserve:"):
            continue
        label_sets = {tuple(sorted(s.labels.items())) for s in family.samples}
        assert len(label_sets) <= 64, family.name
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, (family.name, sample.labels)
    ttft = next(f for f in families if f.name == "hybridserve:time_to_first_token_seconds")
    count = next(s.value for s in ttft.samples if s.name.endswith("_count"))
    assert count >= NUM_CLIENTS - sum(o.disconnected for o in loaded_server[1])
