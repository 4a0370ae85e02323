"""The grid a calibration measures and the held-out fit of its step times.

`Grid.shapes()` lists the step shapes `hybridserve calibrate` times on a device;
`fit_measurements` fits the `Efficiency` constants on some of the measured shapes
(`fit_efficiency`, from several starting points) and reports the error on the others.
`measured_gpu` is the Gpu of a device outside the catalog, from measured peaks.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hybridserve.core.errors import ConfigError
from hybridserve.sim.calibration import ErrorSummary, SampleRow, describe
from hybridserve.sim.cost_model import Efficiency, StepShape
from hybridserve.sim.fit import (
    DEFAULT_PARAMS,
    CostSetup,
    FitResult,
    Sample,
    fit_efficiency,
    objective,
)
from hybridserve.sim.gpus import Gpu


@dataclass(frozen=True, kw_only=True, slots=True)
class Grid:
    """The step shapes to measure and how often."""

    prefill_tokens: tuple[int, ...] = (64, 256, 512)  # one prefill chunk of this many tokens
    prefill_context_tokens: tuple[int, ...] = (0, 1024)  # after this many cached tokens
    decode_batches: tuple[int, ...] = (1, 4, 16)  # decodes in one step
    decode_context_tokens: tuple[int, ...] = (128, 1024, 2048)  # each at this context
    rounds: int = 3  # interleaved passes over every shape
    repeats: int = 2  # timed steps per shape per pass (after one untimed step)
    # The decode batches of more than one request are measured again with this share of their
    # context (whole blocks of SHARED_BLOCK_TOKENS) in the same blocks for every request, as a
    # shared system prompt is: they fit `Efficiency.shared_kv`. 0: not measured, shared_kv 0.
    # Off by default here (a third more decode measurements, for loads whose decodes share a
    # prefix); the fidelity scripts measure it at 0.5, where E1's twins on a CPU missed 6 of 30
    # goals with it and 12 without (one set priced E1's decode steps 0.80-0.89x with it, an
    # earlier one; docs/fidelity.md).
    decode_shared_fraction: float = 0.0

    def __post_init__(self) -> None:
        for name, low in (
            ("prefill_tokens", 1),
            ("decode_batches", 1),
            ("prefill_context_tokens", 0),
            ("decode_context_tokens", 0),
        ):
            values = getattr(self, name)
            if not values or min(values) < low:
                raise ConfigError(f"grid.{name}", values, f"give one or more values >= {low}")
        for name in ("rounds", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"grid.{name}", getattr(self, name), "use 1 or more")
        if not 0 <= self.decode_shared_fraction < 1:
            raise ConfigError(
                "grid.decode_shared_fraction", self.decode_shared_fraction, "use [0, 1)"
            )

    def shapes(self) -> list[StepShape]:
        """Prefills (each length after each cached context), then decode batches."""
        shapes = [
            StepShape.prefill(n, context_tokens=c)
            for c in self.prefill_context_tokens
            for n in self.prefill_tokens
        ]
        shapes += [
            StepShape.decode(batch=b, context_tokens=c)
            for c in self.decode_context_tokens
            for b in self.decode_batches
        ]
        shapes += [
            StepShape.decode(batch=b, context_tokens=c, shared_tokens=self.shared_tokens(c))
            for c in self.decode_context_tokens
            for b in self.decode_batches
            if b > 1 and self.shared_tokens(c) > 0
        ]
        return shapes

    def shared_tokens(self, context_tokens: int) -> int:
        """The shared prefix of the shared decode shapes at `context_tokens`: whole blocks."""
        share = int(self.decode_shared_fraction * context_tokens)
        return share - share % SHARED_BLOCK_TOKENS

    @property
    def max_tokens_per_step(self) -> int:
        """Cache slots the largest shape holds (every request's context and new tokens)."""
        prefill = max(self.prefill_tokens) + max(self.prefill_context_tokens)
        decode = max(self.decode_batches) * (max(self.decode_context_tokens) + 1)
        return max(prefill, decode)


QUICK_GRID = Grid(
    prefill_tokens=(32, 128, 256),
    prefill_context_tokens=(0, 256),
    decode_batches=(1, 4, 8),
    decode_context_tokens=(64, 256),
    rounds=2,
    repeats=2,
)


def with_sharing(grid: Grid, fraction: float) -> Grid:
    """`grid` measuring its decode batches again with `fraction` of each context shared
    (`--decode-shared-fraction`). Raises ConfigError naming the flag."""
    if not 0 <= fraction < 1:
        raise ConfigError("--decode-shared-fraction", fraction, "use a fraction in [0, 1)")
    return replace(grid, decode_shared_fraction=fraction)


def request_tokens(shape: StepShape) -> list[tuple[int, int, int]]:
    """(num_new_tokens, num_context_tokens, shared prefix tokens) per request: what the torch
    timer runs (a `StepShape.decode(shared_tokens=...)` shape shares its prefix)."""
    shared = shape.shared_prefix_tokens
    return [(r.num_new_tokens, r.num_context_tokens, shared) for r in shape.requests]


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrationFit:
    efficiency: Efficiency
    rows: tuple[SampleRow, ...]
    in_sample: ErrorSummary
    held_out: ErrorSummary | None


# A calibration fits the KV cache's read rate apart from the weights' (`Efficiency.kv_hbm`)
# where its decode shapes can tell them apart (three batch sizes at three contexts or more):
# an executor that gathers keys before attending pays its KV bytes more than once, and one
# fraction for both priced E1's long-context decodes on the torch executor at 0.7x their time.
# With fewer decode shapes (`calibrate --url`'s grids: two contexts) a fifth constant fits the
# noise of a few HTTP timings instead, and KV is read at `hbm`'s rate.
CALIBRATION_PARAMS = (*DEFAULT_PARAMS, "kv_hbm")
KV_READ_MIN_SHAPES = 3  # distinct decode batch sizes, and distinct decode contexts
SHARED_BLOCK_TOKENS = 16  # a shared prefix is whole blocks of every executor's block size


def fitted_params(shapes: Sequence[StepShape]) -> tuple[str, ...]:
    """The constants a fit on `shapes` can identify: `CALIBRATION_PARAMS`, or without kv_hbm
    when the decodes span fewer than KV_READ_MIN_SHAPES batch sizes or contexts."""
    decodes = [s for s in shapes if _kind(s) == "decode"]
    batches = {len(s.requests) for s in decodes}
    contexts = {s.requests[0].num_context_tokens for s in decodes}
    if min(len(batches), len(contexts)) >= KV_READ_MIN_SHAPES:
        return CALIBRATION_PARAMS
    return DEFAULT_PARAMS


FIT_STARTS = (
    Efficiency(),
    Efficiency(gemm=0.3, attention=0.3, hbm=0.3, step_overhead_s=1e-4),
    Efficiency(gemm=0.8, attention=0.8, hbm=0.95, step_overhead_s=1e-2),
)


def _kind(shape: StepShape) -> str:
    """ "prefill" (a step with any prefill), "decode", or "shared" (decodes sharing a prefix)."""
    if not all(r.is_decode for r in shape.requests):
        return "prefill"
    return "shared" if shape.shared_kv_tokens else "decode"


def holdout_split(shapes: Sequence[StepShape], *, fraction: float, seed: int) -> set[int]:
    """Indices to hold out: `fraction` of the prefill shapes, of the decode shapes and of the
    shared-prefix decode shapes, chosen with random.Random(seed); each kind keeps at least one
    shape for the fit."""
    if not 0 <= fraction < 1:
        raise ConfigError("holdout_fraction", fraction, "use a fraction in [0, 1)")
    rng = random.Random(seed)
    held: set[int] = set()
    for name in ("prefill", "decode", "shared"):
        kind = [i for i, s in enumerate(shapes) if _kind(s) == name]
        count = min(round(len(kind) * fraction), max(len(kind) - 1, 0))
        held.update(rng.sample(kind, count))
    return held


SHARED_KV_STEPS = 100  # the shared_kv fit tries 0, 0.01, ..., 1


def fit_shared_kv(samples: Sequence[Sample], efficiency: Efficiency) -> Efficiency:
    """`efficiency` with the `shared_kv` that best prices `samples` (decode batches sharing a
    prefix; the other constants as fitted without them): the least mean |log error| over a
    grid of fractions, the smallest of equals. No samples: `efficiency` as it is."""
    if not samples:
        return efficiency
    steps = range(SHARED_KV_STEPS + 1)
    candidates = [replace(efficiency, shared_kv=i / SHARED_KV_STEPS) for i in steps]
    return min(candidates, key=lambda e: (objective(samples, e), e.shared_kv))


def _fit_plan(
    shapes: Sequence[StepShape], setup: CostSetup, *, pin_hbm: bool
) -> tuple[tuple[str, ...], tuple[Efficiency, ...]]:
    """The constants to fit and the starts: `fitted_params`, less hbm where it is pinned (the
    starts then hold it at `pinned_hbm`)."""
    params = fitted_params(shapes)
    hbm = pinned_hbm(setup) if pin_hbm else None
    if hbm is None:
        return params, FIT_STARTS
    return tuple(p for p in params if p != "hbm"), tuple(replace(s, hbm=hbm) for s in FIT_STARTS)


def fit_measurements(
    measurements: Sequence[tuple[StepShape, float]],
    *,
    setup: CostSetup,
    holdout_fraction: float,
    seed: int,
    max_evaluations: int = 800,
    pin_hbm: bool = False,
) -> CalibrationFit:
    """Fit gemm, attention, hbm, step_overhead_s and (where the decodes identify it, see
    `fitted_params`) kv_hbm on the measurements not held out (fractions of `setup.gpu`'s peaks,
    at most 1), leaving out the decode batches that share a prefix; then `shared_kv` on those
    (`fit_shared_kv`); and report the errors of both parts. `pin_hbm`: hbm is kept at the
    device's measured weight stream where it has one (`pinned_hbm`), the rest fitted around
    it."""
    shapes = [shape for shape, _ in measurements]
    held = holdout_split(shapes, fraction=holdout_fraction, seed=seed)
    fitted = [(s, t) for i, (s, t) in enumerate(measurements) if i not in held]
    train = [Sample.of(setup, s, t, describe(s)) for s, t in fitted if _kind(s) != "shared"]
    shared = [Sample.of(setup, s, t, describe(s)) for s, t in fitted if _kind(s) == "shared"]

    # Nelder-Mead finds a local minimum; on CPU measurements the objective has more than one
    # (weight reads against per-step overhead), so start from each corner and keep the best,
    # then restart once from it (a simplex that has collapsed along one of five constants
    # stops short of the minimum).
    params, starts = _fit_plan(shapes, setup, pin_hbm=pin_hbm)

    def fit(start: Efficiency) -> FitResult:
        return fit_efficiency(
            train,
            params=params,
            start=start,
            max_evaluations=max_evaluations,
            tolerance=1e-9,
        )

    best = min((fit(start) for start in starts), key=lambda r: r.objective)
    result = min(best, fit(best.efficiency), key=lambda r: r.objective)
    efficiency = fit_shared_kv(shared, result.efficiency)
    model = setup.cost_model(efficiency)
    rows = tuple(
        SampleRow.of(
            shape,
            measured_s=seconds,
            predicted_s=model.step_cost(shape).total_s,
            held_out=i in held,
        )
        for i, (shape, seconds) in enumerate(measurements)
    )
    in_sample = ErrorSummary.of([r for r in rows if not r.held_out])
    if in_sample is None:  # fit_efficiency already refuses an empty fit set
        raise ConfigError("measurements", len(measurements), "measure at least one step")
    return CalibrationFit(
        efficiency=efficiency,
        rows=rows,
        in_sample=in_sample,
        held_out=ErrorSummary.of([r for r in rows if r.held_out]),
    )


def measured_gpu(
    name: str,
    *,
    fp32_flops: float,
    bf16_flops: float,
    copy_bytes_per_s: float,
    memory_bytes: float,
    fp32_stream_bytes_per_s: float | None = None,
    bf16_stream_bytes_per_s: float | None = None,
) -> Gpu:
    """The 'datasheet' of a device outside the catalog: its measured matmul FLOP/s, copy
    bytes/s (read + written), weight-stream bytes/s (where read) and memory. No interconnect
    was measured: link 0 (tp 1 only)."""
    return Gpu(
        name=name,
        bf16_flops=bf16_flops,
        fp8_flops=None,
        fp4_flops=None,
        fp32_flops=fp32_flops,
        hbm_bytes=memory_bytes,
        hbm_bytes_per_s=copy_bytes_per_s,
        link_bytes_per_s=0.0,
        fp32_stream_bytes_per_s=fp32_stream_bytes_per_s,
        bf16_stream_bytes_per_s=bf16_stream_bytes_per_s,
    )


def pinned_hbm(setup: CostSetup) -> float | None:
    """The `hbm` fraction a pinned fit on `setup` keeps fixed, or None (no stream measured):
    the device's weight-stream rate in the dtype served over its copy rate, at most 1.

    Every step reads the model's weights once and pays a fixed overhead; step times alone price
    their sum, not the split, and on a CPU the free fit lands on either of two minima (overhead
    near 0 with weights read at a quarter of the copy rate, or 20-30 ms with weights at the
    whole rate) that price the measured steps about equally. Pinned to the measured stream, the
    three calibrations of one session agree on the overhead (13-14 ms on SmolLM2, against 0 to
    27 ms free), but they score the real runs no better (docs/fidelity.md), so `calibrate`
    fits hbm freely and records the stream; `benchmarks/calibration_refit.py --pin` pins."""
    stream = setup.gpu.stream_bytes_per_s(setup.dtype)
    if stream is None or not stream > 0:
        return None
    return min(stream / setup.gpu.hbm_bytes_per_s, 1.0)
