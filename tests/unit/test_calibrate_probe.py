"""`calibrate --url`'s probes against a scripted server: each stream of a decode batch gets a
primer of its own, sent once and cached."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import httpx

from hybridserve.loadgen.probe import Prober


def _scripted_server(prompts: list[list[int]]) -> httpx.MockTransport:
    """Answers every completion with `max_tokens` streamed tokens and records its prompt."""

    class Stream(httpx.AsyncByteStream):
        def __init__(self, tokens: int) -> None:
            self.tokens = tokens

        async def __aiter__(self) -> AsyncIterator[bytes]:
            for _ in range(self.tokens):  # one decode step every 2 ms
                await asyncio.sleep(0.002)
                yield b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
            usage = {"choices": [], "usage": {"completion_tokens": self.tokens}}
            yield f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()

    async def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompts.append(body["prompt"])
        return httpx.Response(200, stream=Stream(body["max_tokens"]))

    return httpx.MockTransport(answer)


def test_a_decode_batch_gives_each_stream_its_own_cached_primer() -> None:
    prompts: list[list[int]] = []
    target = SimpleNamespace(
        url="http://scripted", api_key=None, vocab_size=50_000, decode_steps=4, server_speed=1.0
    )

    async def run() -> tuple[list[list[int]], list[list[int]]]:
        transport = _scripted_server(prompts)
        async with httpx.AsyncClient(transport=transport, base_url=target.url) as client:
            prober = Prober(client, target, "m", seed=0)  # type: ignore[arg-type]
            primers = await prober.primers(64, 3)
            sent_first = list(prompts)
            shape, seconds = await prober.decode(primers)
            assert shape.requests[0].num_context_tokens > 64 and seconds >= 0
            assert await prober.primers(64, 3) == primers  # cached: nothing sent again
            assert await prober.primer(64) == primers[0]
            return primers, sent_first

    primers, sent_first = asyncio.run(run())
    assert len({tuple(p) for p in primers}) == 3 and all(len(p) == 64 for p in primers)
    assert sorted(map(tuple, sent_first)) == sorted(map(tuple, primers))  # each sent once
    streams = prompts[3:]
    assert len(streams) == 3
    assert sorted(tuple(s[:64]) for s in streams) == sorted(map(tuple, primers))
