"""`hybridserve calibrate --url`: fit the cost model's constants to a running server, from the
outside.

Every measurement is a controlled request of fresh random token ids (nothing is cached unless
the measurement wants it), streamed and timed on the client. What is measured is a step's
period, the gap between two token deliveries, so the HTTP, queueing and streaming overhead of
a request drops out:

- a prefill of N tokens after M cached ones: a primer of M tokens first (untimed), and a
  background stream that decodes one token a step. The primer plus N fresh tokens is sent; the
  step that prefills it ends with its first token (its TTFT) and with one of the background's
  tokens: that background gap is the step, a mixed one (1 decode + the prefill), priced as
  such. The cached part is the usage's `cached_tokens` where the server reports it (else M).
- a decode batch of B at context C: B concurrent streams of fresh prompts. Once every stream
  has its first tokens and before any ends, each step decodes exactly the B of them: the
  median inter-token gap inside that window is the B-decode step.
- the request overhead (reported, not fitted): a 1-token prompt's TTFT minus its median gap.

The grid is the device calibration's (`hybridserve.sim.calibration_fit.Grid`; each prefill must
fit the server's token budget in one step); every round measures each shape `repeats` times in
a shuffled order (rounds interleave, so a drift of the server spreads over every shape), each
shape's time is the median of its measurements, and the fit and its held-out shapes are the
device calibration's (`fit_measurements`). `server_speed` multiplies every measured time: 1 for
a real server; a `serve --executor sim --sim-speed S` server runs S times faster than the
device it models.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from hybridserve.core.errors import ConfigError
from hybridserve.loadgen.client import (
    Completion,
    completion_body,
    request_headers,
    served_model,
    stream_completion,
)
from hybridserve.sim.calibration import Calibration
from hybridserve.sim.calibration_fit import Grid, fit_measurements
from hybridserve.sim.cost_model import RequestShape, StepShape
from hybridserve.sim.fit import CostSetup
from hybridserve.sim.gpus import GPUS, GpuSpec, get_gpu
from hybridserve.sim.hf_config import load_model_profile
from hybridserve.sim.model_profiles import MODELS, ModelProfile

Progress = Callable[[int, int], None]  # (measurements done, total)

# The shapes `calibrate --url` measures: prefills that fit a 2048-token step budget, contexts
# that fit a 8192-token model (the largest prompt is 4096 + 1024 tokens).
REMOTE_GRID = Grid(
    prefill_tokens=(128, 512, 1024),
    prefill_context_tokens=(0, 4096),
    decode_batches=(1, 8, 32),
    decode_context_tokens=(256, 4096),
    rounds=3,
    repeats=2,
)
# --quick: fewer shapes, one long context (8192 + 1024 tokens: the server's --max-model-len
# must hold 9,300), where the attention term is large enough to fit.
REMOTE_QUICK_GRID = Grid(
    prefill_tokens=(256, 1024),
    prefill_context_tokens=(0, 8192),
    decode_batches=(1, 16),
    decode_context_tokens=(256, 8192),
    rounds=3,
    repeats=2,
)
_OVERHEAD_TOKENS = 8  # answer length of the overhead probe
_BACKGROUND_PROMPT = 8  # prompt tokens of the background stream of a prefill measurement
_BACKGROUND_BEFORE = 6  # its tokens before the prefill is sent
_BACKGROUND_AFTER = 5  # and after the mixed step
_DECODE_FRESH = 8  # fresh prompt tokens of each decode stream, after its cached primer


@dataclass(frozen=True, kw_only=True, slots=True)
class RemoteTarget:
    """The server and what the cost model needs to price its steps."""

    url: str
    model: str | None  # the served name; None: the first /v1/models lists
    api_key: str | None
    gpu: GpuSpec
    peaks: str  # "datasheet" (a catalog GPU) or "measured" (peaks from another calibration)
    profile: ModelProfile
    dtype: str
    kv_dtype: str
    vocab_size: int = 256
    server_speed: float = 1.0
    decode_steps: int = 8  # measured decode steps per stream
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.server_speed > 0:
            raise ConfigError("--server-speed", self.server_speed, "use a factor > 0 (1: real)")
        if self.vocab_size < 2:
            raise ConfigError("--vocab-size", self.vocab_size, "use 2 or more token ids")
        if self.decode_steps < 4:
            raise ConfigError("decode_steps", self.decode_steps, "use 4 or more")


@dataclass(frozen=True, slots=True)
class RemoteCalibration:
    """The fitted calibration and what the black box adds to it."""

    calibration: Calibration
    request_overhead_s: float  # TTFT - step of a 1-token request, median (server time)
    model: str  # the served name

    def to_json(self) -> dict[str, object]:
        data = self.calibration.to_json()
        data["black_box"] = {
            "served_model": self.model,
            "request_overhead_s": self.request_overhead_s,
        }
        return data


class _Prober:
    """Sends the controlled requests; every prompt is fresh random ids."""

    def __init__(self, client: httpx.AsyncClient, target: RemoteTarget, model: str, seed: int):
        self.client, self.target, self.model = client, target, model
        self.rng = random.Random(f"{seed}/calibrate-url")
        self._primers: dict[int, list[int]] = {}

    async def primer(self, length: int) -> list[int]:
        """A prefix of `length` fresh tokens, sent once (untimed) so the server caches it."""
        if length not in self._primers:
            self._primers[length] = self.fresh(length)
            if length:
                await self.send(self._primers[length], 1)
        return self._primers[length]

    def fresh(self, count: int) -> list[int]:
        vocab = self.target.vocab_size
        return [self.rng.randrange(vocab) for _ in range(count)]

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
                raise self.failed(len(live.token_times_s), live.failure or "ended early")
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

    def failed(self, num_prompt: int, why: str) -> ConfigError:
        return ConfigError(
            "--url",
            self.target.url,
            f"a calibration request of {num_prompt} prompt tokens failed ({why}); check the "
            "server's log and its --max-model-len",
        )

    async def decode(self, batch: int, primer: list[int]) -> tuple[StepShape, float]:
        """A step of `batch` decodes, each after `primer` (cached, so their prefills are a few
        fresh tokens each and they start in one step) and a few fresh tokens: once every stream
        has two tokens, each stream's mean gap over the next `decode_steps` tokens; the median
        over the streams."""
        steps = self.target.decode_steps
        streams = [
            self.watch([*primer, *self.fresh(_DECODE_FRESH)], 4 * steps) for _ in range(batch)
        ]
        try:
            for live, task in streams:
                await self.until(live, task, 2)
            marks = [len(live.token_times_s) for live, _ in streams]
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
        return StepShape.decode(batch=batch, context_tokens=context), statistics.median(periods)


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


@dataclass(slots=True)
class _Samples:
    """Per shape index, the measured seconds (server time) and the shape as measured."""

    seconds: dict[int, list[float]]
    shapes: dict[int, StepShape]


async def _measure_round(
    prober: _Prober,
    grid: Grid,
    samples: _Samples,
    overheads: list[float],
    tick: Callable[[], None],
) -> None:
    """One pass over every shape, `grid.repeats` times each, in a shuffled order."""
    speed = prober.target.server_speed
    shapes = grid.shapes()
    order = list(range(len(shapes))) * grid.repeats
    prober.rng.shuffle(order)
    overheads.append(await prober.overhead() * speed)
    for index in order:
        shape = shapes[index]
        request = shape.requests[0]
        primer = await prober.primer(request.num_context_tokens)
        if request.is_decode:
            measured, seconds = await prober.decode(len(shape.requests), primer)
        else:
            measured, seconds = await prober.prefill(primer, request.num_new_tokens)
        samples.shapes.setdefault(index, measured)
        samples.seconds.setdefault(index, []).append(seconds * speed)
        tick()


async def calibrate_remote(
    target: RemoteTarget,
    *,
    grid: Grid,
    seed: int = 0,
    holdout_fraction: float = 0.25,
    progress: Progress | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> RemoteCalibration:
    """Measure `grid` on the server, fit, and return the calibration. Raises
    UnreachableServer when the URL does not answer, ConfigError when a request fails."""
    if not 0 <= holdout_fraction < 1:
        raise ConfigError("--holdout-fraction", holdout_fraction, "use a fraction in [0, 1)")
    timeout = httpx.Timeout(target.request_timeout_s, connect=10.0)
    total, done = len(grid.shapes()) * grid.repeats * grid.rounds, 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    async with httpx.AsyncClient(
        base_url=target.url.rstrip("/"), timeout=timeout, transport=transport
    ) as client:
        listed = await served_model(client, url=target.url, api_key=target.api_key)
        model = target.model or listed
        if model is None:
            raise ConfigError("--model", None, f"{target.url}/v1/models lists none; name it")
        prober = _Prober(client, target, model, seed)
        await prober.send(prober.fresh(16), 4)  # warm the connection and the server
        samples, overheads = _Samples({}, {}), list[float]()
        for _ in range(grid.rounds):
            await _measure_round(prober, grid, samples, overheads, tick)
    overhead = statistics.median(overheads)
    return RemoteCalibration(
        _fit(target, samples, seed=seed, holdout_fraction=holdout_fraction),
        overhead,
        model,
    )


def _fit(
    target: RemoteTarget,
    samples: _Samples,
    *,
    seed: int,
    holdout_fraction: float,
) -> Calibration:
    measurements = [
        (samples.shapes[i], statistics.median(samples.seconds[i])) for i in sorted(samples.shapes)
    ]
    setup = CostSetup(
        gpu=target.gpu, model=target.profile, dtype=target.dtype, kv_dtype=target.kv_dtype
    )
    fit = fit_measurements(measurements, setup=setup, holdout_fraction=holdout_fraction, seed=seed)
    return Calibration(
        device=target.gpu.name,
        gpu=target.gpu,
        peaks=target.peaks,
        efficiency=fit.efficiency,
        model=target.profile.name,
        dtype=target.dtype,
        kv_dtype=target.kv_dtype,
        torch_version="n/a (measured over HTTP)",
        torch_device=f"remote {target.url}",
        num_threads=0,
        clock="wall",
        seed=seed,
        holdout_fraction=holdout_fraction,
        samples=fit.rows,
        in_sample=fit.in_sample,
        held_out=fit.held_out,
    )


def with_context(grid: Grid, context_tokens: int | None) -> Grid:
    """`grid` with its long context replaced (prefills after it, decodes at it); None: as is.
    Raises ConfigError naming --context-tokens."""
    if context_tokens is None:
        return grid
    if context_tokens < 1:
        raise ConfigError("--context-tokens", context_tokens, "use 1 or more tokens")
    short = min(min(grid.decode_context_tokens), context_tokens)
    return replace(
        grid,
        prefill_context_tokens=(0, context_tokens),
        decode_context_tokens=tuple(sorted({short, context_tokens})),
    )


def model_profile_for(model_config: Path | None, model: str | None) -> ModelProfile:
    """The cost model's view of the served model: --model-config (a config.json or its
    folder), else --model when it names a catalog profile or a local checkpoint folder.
    Raises ConfigError naming --model-config."""
    if model_config is not None:
        return load_model_profile(model_config.expanduser())
    if model is not None and model in MODELS:
        return MODELS[model]
    if model is not None and (Path(model).expanduser() / "config.json").is_file():
        return load_model_profile(Path(model).expanduser())
    raise ConfigError(
        "--model-config",
        None,
        f"the cost model needs the served model's shape: give its config.json (--model "
        f"{model!r} is neither a catalog profile ({', '.join(sorted(MODELS))}) nor a local "
        "checkpoint folder)",
    )


def device_for(gpu_name: str, peaks_from: Path | None) -> tuple[GpuSpec, str]:
    """(the device's peaks, their source): a catalog GPU's datasheet, or the measured peaks
    of another calibration of the same device (`hybridserve calibrate --model ... --gpu-name
    NAME` run on it). Raises ConfigError naming --gpu-name or --peaks-from."""
    if peaks_from is not None:
        other = Calibration.load(peaks_from)
        return other.gpu, other.peaks
    if gpu_name not in GPUS:
        raise ConfigError(
            "--gpu-name",
            gpu_name,
            f"over HTTP no peak can be measured: name a catalog GPU ({', '.join(GPUS)}) or "
            "give --peaks-from a calibration measured on that device",
        )
    return get_gpu(gpu_name), "datasheet"
