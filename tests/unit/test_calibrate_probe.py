"""`calibrate --url`'s probes against a scripted server: each stream of a decode batch gets a
primer of its own, cached, and sent again before a measurement that needs it cached; a prefill
the server missed on is its own sample, never pooled with the hits; a decode batch whose
primers the server's pool could not keep at once is named."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from types import SimpleNamespace

import httpx
import pytest

from hybridserve.loadgen.calibrate import RemoteCalibration, _measure_round, _Samples
from hybridserve.loadgen.probe import BatchApart, Prober
from hybridserve.sim.calibration_fit import Grid
from hybridserve.sim.cost_model import RequestShape, StepShape

# What a Prober needs of its target: a scripted server's URL, 4 decode steps per stream.
TARGET = SimpleNamespace(
    url="http://scripted", api_key=None, vocab_size=50_000, decode_steps=4, server_speed=1.0
)


def _scripted_server(
    prompts: list[list[int]], *, pool_prompts: int | None = None, serial: bool = False
) -> httpx.MockTransport:
    """Answers every completion with `max_tokens` streamed tokens and records its prompt. With
    `pool_prompts`, it keeps the last that many prompts and reports as cached the longest of
    them that the prompt starts with (usage.prompt_tokens_details.cached_tokens). `serial`: it
    streams one request at a time (a pool that holds one request)."""
    pool: list[list[int]] = []
    one_at_a_time = asyncio.Lock() if serial else None

    class Stream(httpx.AsyncByteStream):
        def __init__(self, tokens: int, cached: int | None) -> None:
            self.tokens, self.cached = tokens, cached

        async def __aiter__(self) -> AsyncIterator[bytes]:
            if one_at_a_time is not None:
                await one_at_a_time.acquire()
            try:
                for _ in range(self.tokens):  # one decode step every 2 ms
                    await asyncio.sleep(0.002)
                    yield b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
            finally:
                if one_at_a_time is not None:
                    one_at_a_time.release()
            usage: dict[str, object] = {"completion_tokens": self.tokens}
            if self.cached is not None:
                usage["prompt_tokens_details"] = {"cached_tokens": self.cached}
            last = json.dumps({"choices": [], "usage": usage})
            yield f"data: {last}\n\ndata: [DONE]\n\n".encode()

    async def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompt = body["prompt"]
        prompts.append(prompt)
        cached = None
        if pool_prompts is not None:
            held = [len(p) for p in pool if prompt[: len(p)] == p]
            cached = min(max(held, default=0), len(prompt) - 1)
            pool.append(prompt)
            del pool[:-pool_prompts]
        return httpx.Response(200, stream=Stream(body["max_tokens"], cached))

    return httpx.MockTransport(answer)


def test_a_decode_batch_gives_each_stream_its_own_cached_primer() -> None:
    prompts: list[list[int]] = []
    target = TARGET

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
    streams, check = prompts[3:6], prompts[6:]
    assert sorted(tuple(s[:64]) for s in streams) == sorted(map(tuple, primers))
    assert check == [primers[0]]  # after the batch: is its first primer still cached?


def test_a_shared_prefix_batch_sends_one_prefix_first_then_streams_that_all_begin_with_it() -> None:
    """The grid's shared-prefix decode batches: every primer begins with the same tokens, the
    first primer is sent alone before the others (so they find the prefix cached), the streams
    begin with their primers, and the measured shape counts the shared reads."""
    prompts: list[list[int]] = []
    target = TARGET

    async def run() -> tuple[list[list[int]], StepShape]:
        transport = _scripted_server(prompts)
        async with httpx.AsyncClient(transport=transport, base_url=target.url) as client:
            prober = Prober(client, target, "m", seed=0)  # type: ignore[arg-type]
            primers = await prober.primers(64, 3, resend=True, shared=32)
            shape, _ = await prober.decode(primers, shared=32)
            assert await prober.primers(64, 3) != primers  # unshared primers are others
            return primers, shape

    primers, shape = asyncio.run(run())
    assert len({tuple(p[:32]) for p in primers}) == 1 and len({tuple(p) for p in primers}) == 3
    assert prompts[0] == primers[0] and sorted(map(tuple, prompts[1:3])) == sorted(
        map(tuple, primers[1:])
    )
    assert all(stream[:64] in primers for stream in prompts[3:6])
    assert shape.shared_kv_tokens == 2 * 32 and shape.shared_prefix_tokens == 32
    grid = Grid(decode_batches=(1, 4), decode_context_tokens=(100, 256), decode_shared_fraction=0.5)
    assert [(len(s.requests), s.shared_prefix_tokens) for s in grid.shapes()[-2:]] == [
        (4, 48),
        (4, 128),
    ]


def test_a_resent_primer_goes_to_the_server_again_before_its_measurement() -> None:
    prompts: list[list[int]] = []
    target = TARGET

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

    async def primers(
        self, length: int, count: int, *, resend: bool = False, shared: int = 0
    ) -> list[list[int]]:
        self.resends.append(resend)
        return [[0] * length] * count

    async def decode(self, primers: list[list[int]], *, shared: int = 0) -> tuple[StepShape, float]:
        shape = StepShape.decode(
            batch=len(primers), context_tokens=len(primers[0]), shared_tokens=shared
        )
        return shape, 0.1

    async def prefill(self, primer: list[int], new: int) -> tuple[StepShape, float]:
        self.prefills += 1
        hit = self.prefills == 1
        prefill = RequestShape(new, len(primer)) if hit else RequestShape(new + len(primer), 0)
        return StepShape((RequestShape(1, 20), prefill)), 1.0 if hit else 3.0


def _one_prefill_one_decode(rounds: int) -> Grid:
    """A grid of one prefill (1,024 after 2,048) and one decode batch (2 at 256)."""
    return Grid(
        prefill_tokens=(1024,),
        prefill_context_tokens=(2048,),
        decode_batches=(2,),
        decode_context_tokens=(256,),
        decode_shared_fraction=0.0,
        rounds=rounds,
        repeats=1,
    )


def test_a_prefill_round_the_server_missed_is_its_own_sample_not_pooled_with_the_hit() -> None:
    grid = _one_prefill_one_decode(rounds=2)
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


def _decode_batch(pool_prompts: int) -> tuple[set[tuple[int, int]], str | None]:
    """A batch of 3 decode streams on 64-token primers, against a pool of `pool_prompts`."""
    target = TARGET

    async def run() -> set[tuple[int, int]]:
        transport = _scripted_server([], pool_prompts=pool_prompts)
        async with httpx.AsyncClient(transport=transport, base_url=target.url) as client:
            prober = Prober(client, target, "m", seed=0)  # type: ignore[arg-type]
            primers = await prober.primers(64, 3, resend=True)
            await prober.decode(primers)
            return prober.uncached_batches

    uncached = asyncio.run(run())
    result = RemoteCalibration(SimpleNamespace(), 0.0, "m", tuple(sorted(uncached)))  # type: ignore[arg-type]
    return uncached, result.pool_warning()


def test_a_decode_batch_whose_primers_the_pool_could_not_keep_is_named() -> None:
    """Three primers and their three streams through a pool of four prompts: the first primer
    is gone once the batch ran, and the calibration says which batch; a pool of twenty keeps
    it, and nothing is said."""
    uncached, warning = _decode_batch(pool_prompts=4)
    assert uncached == {(3, 64)}
    assert warning is not None and "3 streams x 64 tokens" in warning
    assert _decode_batch(pool_prompts=20) == (set(), None)


def test_a_decode_batch_whose_streams_do_not_run_together_is_left_out_and_named() -> None:
    """A server that streams one request at a time: the first stream has answered all its
    tokens before the last has two, so the batch is no batch there. The probe says so
    (`BatchApart`) instead of failing the calibration, the round goes on without it, and the
    calibration names it."""
    target = TARGET

    async def run() -> set[tuple[int, int]]:
        transport = _scripted_server([], serial=True)
        async with httpx.AsyncClient(transport=transport, base_url=target.url) as client:
            prober = Prober(client, target, "m", seed=0)  # type: ignore[arg-type]
            primers = await prober.primers(64, 3)
            with pytest.raises(BatchApart):
                await prober.decode(primers)
            return prober.apart_batches

    apart = asyncio.run(run())
    assert apart == {(3, 64)}
    fitted = SimpleNamespace(to_json=dict)
    result = RemoteCalibration(fitted, 0.0, "m", (), tuple(apart))  # type: ignore[arg-type]
    warning = result.pool_warning()
    assert warning is not None and "left out of the fit: 3 streams x 64 tokens" in warning
    black_box = result.to_json()["black_box"]
    assert isinstance(black_box, dict) and black_box["unmeasured_decode_batches"] == [[3, 64]]


class _ApartProber(_MissingProber):
    async def decode(self, primers: list[list[int]], *, shared: int = 0) -> tuple[StepShape, float]:
        raise BatchApart("2 streams x 256 tokens")


def test_a_round_goes_on_past_a_batch_that_did_not_run_together() -> None:
    grid = _one_prefill_one_decode(rounds=1)
    prober, samples, ticks = _ApartProber(), _Samples({}, {}), []
    asyncio.run(_measure_round(prober, grid, samples, [], lambda: ticks.append(1)))  # type: ignore[arg-type]
    assert len(ticks) == len(grid.shapes())  # every shape counted for the progress bar
    assert samples.shapes and all(key[1] for key in samples.shapes)  # prefills only
