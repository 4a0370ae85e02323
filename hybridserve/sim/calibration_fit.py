"""The grid a calibration measures and the held-out fit of its step times.

`Grid.shapes()` lists the step shapes `hybridserve calibrate` times on a device;
`fit_measurements` fits the `Efficiency` constants on some of the measured shapes
(`fit_efficiency`, from several starting points) and reports the error on the others.
`measured_gpu` is the Gpu of a device outside the catalog, from measured peaks.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from hybridserve.core.errors import ConfigError
from hybridserve.sim.calibration import ErrorSummary, SampleRow, describe
from hybridserve.sim.cost_model import Efficiency, StepShape
from hybridserve.sim.fit import DEFAULT_PARAMS, CostSetup, FitResult, Sample, fit_efficiency
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
        return shapes

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


def request_tokens(shape: StepShape) -> list[tuple[int, int]]:
    """(num_new_tokens, num_context_tokens) per request: what the torch timer runs."""
    return [(r.num_new_tokens, r.num_context_tokens) for r in shape.requests]


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


def fitted_params(shapes: Sequence[StepShape]) -> tuple[str, ...]:
    """The constants a fit on `shapes` can identify: `CALIBRATION_PARAMS`, or without kv_hbm
    when the decodes span fewer than KV_READ_MIN_SHAPES batch sizes or contexts."""
    decodes = [s for s in shapes if s.requests and all(r.is_decode for r in s.requests)]
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


def holdout_split(shapes: Sequence[StepShape], *, fraction: float, seed: int) -> set[int]:
    """Indices to hold out: `fraction` of the prefill shapes and of the decode shapes, chosen
    with random.Random(seed); each kind keeps at least one shape for the fit."""
    if not 0 <= fraction < 1:
        raise ConfigError("holdout_fraction", fraction, "use a fraction in [0, 1)")
    rng = random.Random(seed)
    held: set[int] = set()
    for decode in (False, True):
        kind = [i for i, s in enumerate(shapes) if all(r.is_decode for r in s.requests) == decode]
        count = min(round(len(kind) * fraction), max(len(kind) - 1, 0))
        held.update(rng.sample(kind, count))
    return held


def fit_measurements(
    measurements: Sequence[tuple[StepShape, float]],
    *,
    setup: CostSetup,
    holdout_fraction: float,
    seed: int,
    max_evaluations: int = 800,
) -> CalibrationFit:
    """Fit gemm, attention, hbm, step_overhead_s and (where the decodes identify it, see
    `fitted_params`) kv_hbm on the measurements not held out (fractions of `setup.gpu`'s peaks,
    at most 1), and report the errors of both parts."""
    shapes = [shape for shape, _ in measurements]
    held = holdout_split(shapes, fraction=holdout_fraction, seed=seed)
    train = [
        Sample.of(setup, shape, seconds, describe(shape))
        for i, (shape, seconds) in enumerate(measurements)
        if i not in held
    ]

    # Nelder-Mead finds a local minimum; on CPU measurements the objective has more than one
    # (weight reads against per-step overhead), so start from each corner and keep the best,
    # then restart once from it (a simplex that has collapsed along one of five constants
    # stops short of the minimum).
    params = fitted_params(shapes)

    def fit(start: Efficiency) -> FitResult:
        return fit_efficiency(
            train,
            params=params,
            start=start,
            max_evaluations=max_evaluations,
            tolerance=1e-9,
        )

    best = min((fit(start) for start in FIT_STARTS), key=lambda r: r.objective)
    result = min(best, fit(best.efficiency), key=lambda r: r.objective)
    model = setup.cost_model(result.efficiency)
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
        efficiency=result.efficiency,
        rows=rows,
        in_sample=in_sample,
        held_out=ErrorSummary.of([r for r in rows if r.held_out]),
    )


def measured_gpu(
    name: str, *, fp32_flops: float, bf16_flops: float, copy_bytes_per_s: float, memory_bytes: float
) -> Gpu:
    """The 'datasheet' of a device outside the catalog: its measured matmul FLOP/s, copy
    bytes/s (read + written) and memory. No interconnect was measured: link 0 (tp 1 only)."""
    return Gpu(
        name=name,
        bf16_flops=bf16_flops,
        fp8_flops=None,
        fp4_flops=None,
        fp32_flops=fp32_flops,
        hbm_bytes=memory_bytes,
        hbm_bytes_per_s=copy_bytes_per_s,
        link_bytes_per_s=0.0,
    )
