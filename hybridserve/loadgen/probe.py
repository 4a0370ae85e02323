"""The controlled requests of `calibrate --url` (see hybridserve.loadgen.calibrate): fresh
prompts, cached primers, a background stream around a prefill, concurrent decode streams, and
`step_at`, the length of one step read off a stream's token times."""

from __future__ import annotations

import asyncio
import itertools
import random
import secrets
import statistics
from collections.abc import Sequence
from typing import Protocol

import httpx

from hybridserve.core.errors import ConfigError
from hybridserve.loadgen.client import (
    Completion,
    completion_body,
    request_headers,
    stream_completion,
)
from hybridserve.sim.cost_model import RequestShape, StepShape

_OVERHEAD_TOKENS = 8  # answer length of the overhead probe
_BACKGROUND_PROMPT = 8  # prompt tokens of the background stream of a prefill measurement
_BACKGROUND_BEFORE = 6  # its tokens before the prefill is sent
_BACKGROUND_AFTER = 5  # and after the mixed step
_DECODE_FRESH = 8  # fresh prompt tokens of each decode stream, after its cached primer


class BatchApart(Exception):
    """A decode batch's streams did not run together: one had answered most of its tokens
    before the last had two (the server could not hold the whole batch at once)."""


class ProbeTarget(Protocol):
    @property
    def url(self) -> str: ...

    @property
    def api_key(self) -> str | None: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def decode_steps(self) -> int: ...

    @property
    def server_speed(self) -> float: ...


class Prober:
    """Sends the controlled requests; every prompt is fresh random ids."""

    def __init__(self, client: httpx.AsyncClient, target: ProbeTarget, model: str, seed: int):
        self.client, self.target, self.model = client, target, model
        self.rng = random.Random(f"{seed}/calibrate-url")  # the order of the shapes
        # Token ids differ on every run: a second calibration of the same server must not hit
        # the first one's cached prompts.
        self._tokens = random.Random(secrets.randbits(64))
        # Primers by (length, shared prefix, index), and each shared prefix by (length, shared).
        self._primers: dict[tuple[int, int, int], list[int]] = {}
        self._common: dict[tuple[int, int], list[int]] = {}
        # Decode batches (streams, primer tokens) whose first primer the server no longer held
        # once the batch had run: its pool cannot keep that many primers at once.
        self.uncached_batches: set[tuple[int, int]] = set()
        # Decode batches whose streams did not run together (`BatchApart`): not measured.
        self.apart_batches: set[tuple[int, int]] = set()

    async def primer(self, length: int, *, resend: bool = False) -> list[int]:
        """A prefix of `length` fresh tokens, sent (untimed) so the server caches it."""
        return (await self.primers(length, 1, resend=resend))[0]

    async def primers(
        self, length: int, count: int, *, resend: bool = False, shared: int = 0
    ) -> list[list[int]]:
        """`count` different prefixes of `length` fresh tokens each, sent at once (untimed) so
        the server caches them: a decode batch's streams each get their own, as requests of a
        real load share no more than a system prompt (with one primer for all, a batch read
        the same KV: a server with shared-prefix attention ran it as one call, any CPU read it
        from its caches, and the decodes timed short). The ones not sent before are sent; with
        `resend`, all of them, right before their measurement: a pool that evicted a primer
        since it was first sent would otherwise serve a cache miss where the shape wants a
        hit (on a 2,048-block pool Gemma 3's six groups hold about 11k tokens, and a
        calibration round's other primers evicted its prefills' primer). With `shared`, every
        primer begins with the same `shared` tokens (a shared system prompt: the grid's decode
        batches that share a prefix); the first is sent before the others, so that they find
        the prefix cached rather than all computing it at once."""
        key = (length, shared)
        missing = [i for i in range(count) if (*key, i) not in self._primers]
        if key not in self._common:
            self._common[key] = self.fresh(shared)
        common = self._common[key]
        for i in missing:
            self._primers[*key, i] = [*common, *self.fresh(length - shared)]
        send = list(range(count) if resend else missing)
        if length and send:
            if shared:
                await self.send(self._primers[*key, send[0]], 1)
                send = send[1:]
            await asyncio.gather(*(self.send(self._primers[*key, i], 1) for i in send))
        return [self._primers[*key, i] for i in range(count)]

    def fresh(self, count: int) -> list[int]:
        vocab = self.target.vocab_size
        return [self._tokens.randrange(vocab) for _ in range(count)]

    async def send(self, prompt: list[int], max_tokens: int) -> Completion:
        body = completion_body(
            model=self.model, prompt=prompt, max_tokens=max_tokens, session_id=None
        )
        done = await stream_completion(
            self.client, body, headers=request_headers(self.target.api_key, None)
        )
        if done.failure is not None or not done.token_times_s:
            raise self.failed(len(prompt), done.failure or "no token")
        return done

    async def overhead(self) -> float:
        done = await self.send(self.fresh(1), _OVERHEAD_TOKENS)
        times = done.token_times_s
        step = statistics.median(b - a for a, b in itertools.pairwise(times))
        return max(times[0] - done.sent_s - step, 0.0)

    def watch(
        self, prompt: list[int], max_tokens: int
    ) -> tuple[Completion, asyncio.Task[Completion]]:
        """Start a stream whose Completion fills as its tokens come."""
        live = Completion(sent_s=0.0)
        body = completion_body(
            model=self.model, prompt=prompt, max_tokens=max_tokens, session_id=None
        )
        headers = request_headers(self.target.api_key, None)
        task = asyncio.ensure_future(
            stream_completion(self.client, body, headers=headers, into=live)
        )
        return live, task

    async def until(self, live: Completion, task: asyncio.Task[Completion], tokens: int) -> None:
        """Until `live` has `tokens` tokens; raises if its stream ends first."""
        while len(live.token_times_s) < tokens:
            if task.done():
                why = live.failure or "ended early"
                raise self.failed(len(live.token_times_s), why, streamed=True)
            await asyncio.sleep(0.0005)

    async def prefill(self, primer: list[int], new: int) -> tuple[StepShape, float]:
        """The mixed step that prefills `primer` + `new` fresh tokens next to one decode, and
        its seconds: the step that ends at the background's token that came with the
        prefill's first token (`step_at`)."""
        background, task = self.watch(self.fresh(_BACKGROUND_PROMPT), 4096)
        try:
            await self.until(background, task, _BACKGROUND_BEFORE)
            sent = len(background.token_times_s)
            done = await self.send([*primer, *self.fresh(new)], 1)
            first = done.token_times_s[0]
            times = background.token_times_s
            while times[-1] < first - 1e-4:
                await self.until(background, task, len(times) + 1)
            k = min(range(sent, len(times)), key=lambda i: abs(times[i] - first))
            await self.until(background, task, k + 1 + _BACKGROUND_AFTER)
        finally:
            task.cancel()
        step = step_at(times[: k + 1 + _BACKGROUND_AFTER], k, clean_until=sent)
        cached = done.cached_tokens if done.cached_tokens is not None else len(primer)
        total = len(primer) + new
        shape = StepShape(
            (
                RequestShape(1, _BACKGROUND_PROMPT + k),
                RequestShape(total - cached, cached),
            )
        )
        return shape, step

    def failed(self, num_tokens: int, why: str, *, streamed: bool = False) -> ConfigError:
        what = (
            f"after {num_tokens} streamed tokens" if streamed else f"of {num_tokens} prompt tokens"
        )
        return ConfigError(
            "--url",
            self.target.url,
            f"a calibration request {what} failed ({why}); check the server's log and its "
            "--max-model-len",
        )

    async def decode(self, primers: list[list[int]], *, shared: int = 0) -> tuple[StepShape, float]:
        """A step of one decode per primer (of equal lengths, the first `shared` tokens of each
        the same), each after its primer (cached, so their prefills are a few fresh tokens each
        and they start in one step) and a few fresh tokens: once every stream has two tokens,
        each stream's mean gap over the next `decode_steps` tokens; the median over the
        streams."""
        steps, batch, primer = self.target.decode_steps, len(primers), primers[0]
        streams = [self.watch([*p, *self.fresh(_DECODE_FRESH)], 4 * steps) for p in primers]
        try:
            for live, task in streams:
                await self.until(live, task, 2)
            marks = [len(live.token_times_s) for live, _ in streams]
            if max(marks) + steps > 4 * steps:
                self.apart_batches.add((batch, len(primer)))
                raise BatchApart(f"{batch} streams x {len(primer)} tokens")
            for (live, task), mark in zip(streams, marks, strict=True):
                await self.until(live, task, mark + steps)
        finally:
            for _, task in streams:
                task.cancel()
        periods = [
            (live.token_times_s[mark + steps - 1] - live.token_times_s[mark - 1]) / steps
            for (live, _), mark in zip(streams, marks, strict=True)
        ]
        context = len(primer) + _DECODE_FRESH + max(marks) + steps // 2
        await self._check_kept(primers)
        shape = StepShape.decode(batch=batch, context_tokens=context, shared_tokens=shared)
        return shape, statistics.median(periods)

    async def _check_kept(self, primers: list[list[int]]) -> None:
        """After a batch ran, ask for its first primer again (one token): a server that reports
        less than half of it cached no longer held it, so the batch's streams did not all start
        on cached primers (their timing starts once every stream has tokens, so the measured
        period stays a decode step's; the calibration says the pool was short)."""
        done = await self.send(primers[0], 1)
        if done.cached_tokens is not None and 2 * done.cached_tokens < len(primers[0]):
            self.uncached_batches.add((len(primers), len(primers[0])))


def step_at(times: Sequence[float], k: int, *, clean_until: int | None = None) -> float:
    """The length of the step that ends at token `k` of a stream whose other steps all last
    the same: token times follow a line of one slope with a jump at `k`; the least-squares
    slope (pooled over both sides) plus the jump. Tokens from `clean_until` to k - 1 (those
    that came while the prefill was sent and admitted, which the admission may delay) are left
    out. Every other timestamp counts, so one late token moves the answer by a fraction of its
    lateness."""
    before_end = k if clean_until is None else min(clean_until, k)
    if before_end < 2 or len(times) - k < 2:
        raise ValueError(f"k={k}: the step needs two tokens on each side of it")
    sides = [list(enumerate(times[:before_end])), list(enumerate(times[k:], start=k))]
    means = [
        (statistics.fmean(i for i, _ in side), statistics.fmean(t for _, t in side))
        for side in sides
    ]
    covariance = variance = 0.0
    for side, (mean_i, mean_t) in zip(sides, means, strict=True):
        covariance += sum((i - mean_i) * (t - mean_t) for i, t in side)
        variance += sum((i - mean_i) ** 2 for i, _ in side)
    slope = covariance / variance
    (before_i, before_t), (after_i, after_t) = means
    jump = (after_t - slope * after_i) - (before_t - slope * before_i)
    return slope + jump
