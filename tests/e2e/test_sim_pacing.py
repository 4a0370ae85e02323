"""`serve --executor sim` paces like a real engine: a step's tokens arrive when its modelled time
ends (a TTFT includes the prefill), and no step's tokens are lost while requests keep coming."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from hybridserve.cli.sim_backend import SimServingBackend
from hybridserve.sim.cost_model import RooflineCostModel, StepShape
from hybridserve.sim.gpus import get_gpu
from hybridserve.sim.model_profiles import get_model
from tests.e2e.conftest import start_server

MODEL = "llama-3.1-8b"


def _backend() -> SimServingBackend:
    return SimServingBackend(
        model_profile=MODEL, gpu="A100-80G", dtype="bf16", sim_speed=1.0, max_model_len=4096
    )


async def _stream(http: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of the stream's chunks, from sending the request."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    body["stream"] = True
    start, times = time.monotonic(), []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                times.append(time.monotonic() - start)
    return times


def test_a_prefills_first_token_comes_when_its_modelled_step_ends() -> None:
    cost = RooflineCostModel(get_gpu("A100-80G"), get_model(MODEL), dtype="bf16")
    prefill_s = cost.step_cost(StepShape.prefill(2000)).total_s  # ~0.19 s
    server = start_server(backend=_backend())
    try:

        async def run() -> list[float]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
                return await _stream(http, [7] * 2000, 1)

        (ttft,) = asyncio.run(run())
    finally:
        server.stop()
    assert ttft >= 0.95 * prefill_s, (ttft, prefill_s)


def test_every_token_arrives_while_requests_keep_coming() -> None:
    server = start_server(backend=_backend())
    try:

        async def run() -> list[list[float]]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:

                async def later(i: int) -> list[float]:
                    await asyncio.sleep(0.007 * i)  # arrivals spread over the steps
                    return await _stream(http, [i % 250] * (64 + 97 * i), 24)

                return await asyncio.gather(*(later(i) for i in range(12)))

        streams = asyncio.run(run())
    finally:
        server.stop()
    assert [len(s) for s in streams] == [24] * 12
