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
  median inter-token gap inside that window is the B-decode step. The grid measures each batch
  of more than one stream again with prompts that begin with the same S tokens (a shared system
  prompt, cached once): those fit `Efficiency.shared_kv`.
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

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from hybridserve.core.errors import ConfigError
from hybridserve.loadgen.client import served_model
from hybridserve.loadgen.probe import BatchApart, Prober
from hybridserve.sim.calibration import Calibration
from hybridserve.sim.calibration_fit import Grid, fit_measurements
from hybridserve.sim.cost_model import StepShape
from hybridserve.sim.fit import CostSetup
from hybridserve.sim.gpus import GPUS, Gpu, get_gpu
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


@dataclass(frozen=True, kw_only=True, slots=True)
class RemoteTarget:
    """The server and what the cost model needs to price its steps."""

    url: str
    model: str | None  # the served name; None: the first /v1/models lists
    api_key: str | None
    gpu: Gpu
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
    # Decode batches (streams, primer tokens) whose primers the server's pool could not keep
    # all at once (`Prober.uncached_batches`), and those whose streams did not even run
    # together (`Prober.apart_batches`: not measured), in order.
    uncached_batches: tuple[tuple[int, int], ...] = ()
    apart_batches: tuple[tuple[int, int], ...] = ()

    def to_json(self) -> dict[str, object]:
        data = self.calibration.to_json()
        data["black_box"] = {
            "served_model": self.model,
            "request_overhead_s": self.request_overhead_s,
            "uncached_decode_batches": [list(b) for b in self.uncached_batches],
            "unmeasured_decode_batches": [list(b) for b in self.apart_batches],
        }
        return data

    def pool_warning(self) -> str | None:
        """What the user should know when some decode batch's primers did not stay cached."""
        parts = []
        if self.apart_batches:
            parts.append(
                "these decode batches did not run together on the server and were left out of "
                f"the fit: {_batches(self.apart_batches)}"
            )
        if self.uncached_batches:
            parts.append(
                "the server did not keep every primer of these decode batches cached: "
                f"{_batches(self.uncached_batches)} (their streams started over several prefill "
                "steps; the periods are still measured once every stream has tokens)"
            )
        if not parts:
            return None
        return (
            "; ".join(parts) + ". Give the server a larger KV pool, or calibrate with a shorter "
            "long context (--context-tokens) for batches that run together as the grid intends"
        )


def _batches(batches: Sequence[tuple[int, int]]) -> str:
    return ", ".join(f"{b} streams x {t} tokens" for b, t in batches)


# A sample's key: the grid's shape index, and for a prefill the tokens it computed and those the
# server reported cached (a miss is another shape than the hit the grid asked for).
SampleKey = tuple[int, int, int]


@dataclass(slots=True)
class _Samples:
    """Per shape as measured, its seconds (server time) over the rounds and the shape."""

    seconds: dict[SampleKey, list[float]]
    shapes: dict[SampleKey, StepShape]


async def _measure_round(
    prober: Prober,
    grid: Grid,
    samples: _Samples,
    overheads: list[float],
    tick: Callable[[], None],
) -> None:
    """One pass over every shape, `grid.repeats` times each, in a shuffled order. A decode
    batch's samples pool over the rounds by shape; a prefill's only where the server computed
    and cached the same tokens (its reported `cached_tokens`), so a miss on one round is its own
    sample instead of moving the hit's median."""
    speed = prober.target.server_speed
    shapes = grid.shapes()
    order = list(range(len(shapes))) * grid.repeats
    prober.rng.shuffle(order)
    overheads.append(await prober.overhead() * speed)
    for index in order:
        shape = shapes[index]
        request = shape.requests[0]
        if request.is_decode:
            shared = shape.shared_prefix_tokens
            primers = await prober.primers(
                request.num_context_tokens, len(shape.requests), resend=True, shared=shared
            )
            try:
                measured, seconds = await prober.decode(primers, shared=shared)
            except BatchApart:
                tick()  # not one batch on this server: named, and left out of the fit
                continue
            key: SampleKey = (index, 0, 0)
        else:
            primer = await prober.primer(request.num_context_tokens, resend=True)
            measured, seconds = await prober.prefill(primer, request.num_new_tokens)
            prefill = measured.requests[-1]
            key = (index, prefill.num_new_tokens, prefill.num_context_tokens)
        samples.shapes.setdefault(key, measured)
        samples.seconds.setdefault(key, []).append(seconds * speed)
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
        prober = Prober(client, target, model, seed)
        await prober.send(prober.fresh(16), 4)  # warm the connection and the server
        samples, overheads = _Samples({}, {}), list[float]()
        for _ in range(grid.rounds):
            await _measure_round(prober, grid, samples, overheads, tick)
    if not any(shape.requests[0].is_decode for shape in samples.shapes.values()):
        raise ConfigError(
            "--url",
            target.url,
            "no decode batch of the grid ran together on the server "
            f"({_batches(sorted(prober.apart_batches))}): its KV pool holds too few tokens; "
            "give it a larger pool, or a shorter long context (--context-tokens)",
        )
    overhead = statistics.median(overheads)
    return RemoteCalibration(
        _fit(target, samples, seed=seed, holdout_fraction=holdout_fraction),
        overhead,
        model,
        tuple(sorted(prober.uncached_batches)),
        tuple(sorted(prober.apart_batches)),
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


def device_for(gpu_name: str, peaks_from: Path | None) -> tuple[Gpu, str]:
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
