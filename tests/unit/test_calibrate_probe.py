"""`calibrate --url`'s probes against a scripted server: each stream of a decode batch gets a
primer of its own, cached, and sent again before a measurement that needs it cached; a prefill
the server missed on is its own sample, never pooled with the hits."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from types import SimpleNamespace

import httpx

from hybridserve.loadgen.calibrate import _measure_round, _Samples
from hybridserve.loadgen.probe import Prober
from hybridserve.sim.calibration_fit import Grid
from hybridserve.sim.cost_model import RequestShape, StepShape


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


def test_a_resent_primer_goes_to_the_server_again_before_its_measurement() -> None:
    prompts: list[list[int]] = []
    target = SimpleNamespace(
        url="http://scripted", api_key=None, vocab_size=50_000, decode_steps=4, server_speed=1.0
    )

    async def run() -> list[list[int]]:
        transport = _scripted_server(prompts)
        async with httpx.AsyncClient(transport=transport, base_url=target.url) as client:
            prober = Prober(client, target, "m", seed=0)  # type: ignore[arg-type]
            primers = await prober.primers(64, 2)
            assert len(prompts) == 2
            assert await prober.primers(64, 2, resend=True) == primers  # the same tokens
            assert len(prompts) == 4
            assert await prober.primer(64, resend=True) == primers[0]
            assert len(prompts) == 5
            return primers

    primers = asyncio.run(run())
    assert prompts[2:4] == primers and prompts[4] == primers[0]


class _MissingProber:
    """A prober whose server misses the prefill's cached primer on the second round."""

    def __init__(self) -> None:
        self.target = SimpleNamespace(server_speed=1.0)
        self.rng = random.Random(0)
        self.prefills = 0
        self.resends: list[bool] = []

    async def overhead(self) -> float:
        return 0.0

    async def primer(self, length: int, *, resend: bool = False) -> list[int]:
        self.resends.append(resend)
        return [0] * length

    async def primers(self, length: int, count: int, *, resend: bool = False) -> list[list[int]]:
        self.resends.append(resend)
        return [[0] * length] * count

    async def decode(self, primers: list[list[int]]) -> tuple[StepShape, float]:
        return StepShape.decode(batch=len(primers), context_tokens=len(primers[0])), 0.1

    async def prefill(self, primer: list[int], new: int) -> tuple[StepShape, float]:
        self.prefills += 1
        hit = self.prefills == 1
        prefill = RequestShape(new, len(primer)) if hit else RequestShape(new + len(primer), 0)
        return StepShape((RequestShape(1, 20), prefill)), 1.0 if hit else 3.0


def test_a_prefill_round_the_server_missed_is_its_own_sample_not_pooled_with_the_hit() -> None:
    grid = Grid(
        prefill_tokens=(1024,),
        prefill_context_tokens=(2048,),
        decode_batches=(2,),
        decode_context_tokens=(256,),
        rounds=2,
        repeats=1,
    )
    prober, samples = _MissingProber(), _Samples({}, {})

    async def run() -> None:
        for _ in range(2):
            await _measure_round(prober, grid, samples, [], lambda: None)  # type: ignore[arg-type]

    asyncio.run(run())
    assert all(prober.resends)  # every measurement sent its primers again
    prefill_keys = sorted(k for k in samples.shapes if k[1])
    assert prefill_keys == [(prefill_keys[0][0], 1024, 2048), (prefill_keys[0][0], 3072, 0)]
    assert [samples.seconds[k] for k in prefill_keys] == [[1.0], [3.0]]
    decode_keys = [k for k in samples.shapes if not k[1]]
    assert len(decode_keys) == 1 and samples.seconds[decode_keys[0]] == [0.1, 0.1]  # pooled
