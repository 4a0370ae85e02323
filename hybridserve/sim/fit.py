"""Fit the cost model's `Efficiency` constants to measured step times (plain-Python Nelder-Mead).

A `Sample` is a measured duration and the steps it covers: one `(StepShape, seconds)` pair from a
profiler, or the weighted steps of a whole benchmark run (a throughput row: every step of the
run, measured as tokens / published tokens per second). The fit minimises the mean absolute
log error of predicted over measured seconds, over fractions kept in (0, 1] (fitted as logits)
and non-negative latencies (fitted as logs), so the result is always a valid `Efficiency`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from hybridserve.core.errors import ConfigError
from hybridserve.sim.cost_model import Efficiency, RooflineCostModel, StepShape
from hybridserve.sim.gpus import Gpu
from hybridserve.sim.model_profiles import ModelProfile

FRACTIONS = ("gemm", "attention", "hbm", "link", "kv_hbm")
LATENCIES = ("collective_latency_s", "step_overhead_s")
DEFAULT_PARAMS = ("gemm", "attention", "hbm", "step_overhead_s")


@dataclass(frozen=True, kw_only=True, slots=True)
class CostSetup:
    """What a cost model needs besides its constants: GPU, model, parallelism and dtypes."""

    gpu: Gpu
    model: ModelProfile
    tp: int = 1
    dtype: str = "bf16"
    kv_dtype: str = "bf16"

    def cost_model(self, efficiency: Efficiency) -> RooflineCostModel:
        return RooflineCostModel(
            self.gpu,
            self.model,
            tp=self.tp,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            efficiency=efficiency,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """`measured_s` seconds for the weighted sum of these steps' modelled times."""

    setup: CostSetup
    steps: tuple[tuple[StepShape, float], ...]  # (shape, weight): weight 1 = one step
    measured_s: float
    label: str = ""

    def __post_init__(self) -> None:
        if not self.measured_s > 0:
            raise ConfigError(f"sample {self.label}.measured_s", self.measured_s, "use > 0 s")
        if not self.steps:
            raise ConfigError(f"sample {self.label}.steps", (), "give at least one step")

    @classmethod
    def of(cls, setup: CostSetup, shape: StepShape, measured_s: float, label: str = "") -> Sample:
        """One measured step."""
        return cls(setup=setup, steps=((shape, 1.0),), measured_s=measured_s, label=label)

    def predicted_s(self, efficiency: Efficiency) -> float:
        model = self.setup.cost_model(efficiency)
        return sum(weight * model.step_cost(shape).total_s for shape, weight in self.steps)


@dataclass(frozen=True, slots=True)
class FitResult:
    efficiency: Efficiency
    relative_errors: tuple[float, ...]  # predicted / measured - 1, per sample
    objective: float  # mean |log(predicted / measured)| at the fitted constants
    evaluations: int


def _encode(
    efficiency: Efficiency, params: Sequence[str], upper: Mapping[str, float]
) -> list[float]:
    point = []
    for name in params:
        value = float(efficiency.kv_bandwidth if name == "kv_hbm" else getattr(efficiency, name))
        if name in FRACTIONS:
            share = min(value / upper.get(name, 1.0), 1 - 1e-6)
            point.append(math.log(share / (1 - share)))
        else:
            point.append(math.log(max(value, 1e-9)))
    return point


def _decode(
    base: Efficiency, params: Sequence[str], point: Sequence[float], upper: Mapping[str, float]
) -> Efficiency:
    values: dict[str, float] = {}
    for name, x in zip(params, point, strict=True):
        if name in FRACTIONS:
            share = 1 / (1 + math.exp(-max(min(x, 30.0), -30.0)))
            values[name] = upper.get(name, 1.0) * share
        else:
            values[name] = math.exp(max(min(x, 5.0), -30.0))
    return replace(base, **values)


def objective(samples: Sequence[Sample], efficiency: Efficiency) -> float:
    """Mean |log(predicted / measured)| over the samples."""
    total = 0.0
    for sample in samples:
        total += abs(math.log(sample.predicted_s(efficiency) / sample.measured_s))
    return total / len(samples)


def fit_efficiency(
    samples: Sequence[Sample],
    *,
    params: Sequence[str] = DEFAULT_PARAMS,
    start: Efficiency | None = None,  # None: Efficiency()
    upper: Mapping[str, float] | None = None,  # upper bounds of fractions (default 1)
    max_evaluations: int = 400,
    tolerance: float = 1e-7,
) -> FitResult:
    """The constants in `params` that minimise `objective`, the others kept from `start`;
    each fraction stays below its `upper` bound (e.g. the top of its published range).

    Raises ConfigError for an unknown parameter name, a bound outside (0, 1] or no samples.
    """
    if not samples:
        raise ConfigError("samples", [], "give at least one measured sample")
    for name in params:
        if name not in FRACTIONS + LATENCIES:
            raise ConfigError("params", name, f"use names from {FRACTIONS + LATENCIES}")

    bounds = dict(upper or {})
    for name, bound in bounds.items():
        if name not in FRACTIONS or not 0 < bound <= 1:
            raise ConfigError(f"upper.{name}", bound, f"bound one of {FRACTIONS} within (0, 1]")
    base = Efficiency() if start is None else start
    if any(getattr(base, name) >= bound for name, bound in bounds.items()):
        base = replace(base, **{n: min(getattr(base, n), 0.9 * b) for n, b in bounds.items()})

    def loss(point: Sequence[float]) -> float:
        return objective(samples, _decode(base, params, point, bounds))

    best, evaluations = nelder_mead(
        loss, _encode(base, params, bounds), max_evaluations=max_evaluations, tolerance=tolerance
    )
    fitted = _decode(base, params, best, bounds)
    errors = tuple(s.predicted_s(fitted) / s.measured_s - 1 for s in samples)
    return FitResult(fitted, errors, objective(samples, fitted), evaluations)


def nelder_mead(
    loss: Callable[[Sequence[float]], float],
    start: Sequence[float],
    *,
    step: float = 0.5,
    max_evaluations: int = 400,
    tolerance: float = 1e-7,
) -> tuple[list[float], int]:
    """Minimise `loss` from `start` (standard coefficients: reflect 1, expand 2, contract 0.5,
    shrink 0.5). Returns the best point and the number of evaluations."""
    simplex = [list(start)]
    for i in range(len(start)):
        vertex = list(start)
        vertex[i] += step
        simplex.append(vertex)
    values = [loss(v) for v in simplex]
    evaluations = len(simplex)
    while evaluations < max_evaluations:
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] <= tolerance:
            break
        centroid = [sum(c) / (len(simplex) - 1) for c in zip(*simplex[:-1], strict=True)]
        worst = simplex[-1]

        def toward(
            scale: float, centroid: list[float] = centroid, worst: list[float] = worst
        ) -> list[float]:
            return [c + scale * (w - c) for c, w in zip(centroid, worst, strict=True)]

        reflected = toward(-1.0)
        r_value = loss(reflected)
        evaluations += 1
        if r_value < values[0]:
            expanded = toward(-2.0)
            e_value = loss(expanded)
            evaluations += 1
            simplex[-1], values[-1] = (
                (expanded, e_value) if e_value < r_value else (reflected, r_value)
            )
        elif r_value < values[-2]:
            simplex[-1], values[-1] = reflected, r_value
        else:
            contracted = toward(0.5)
            c_value = loss(contracted)
            evaluations += 1
            if c_value < values[-1]:
                simplex[-1], values[-1] = contracted, c_value
            else:
                best = simplex[0]
                for i in range(1, len(simplex)):
                    simplex[i] = [b + 0.5 * (x - b) for b, x in zip(best, simplex[i], strict=True)]
                    values[i] = loss(simplex[i])
                evaluations += len(simplex) - 1
    index = min(range(len(simplex)), key=values.__getitem__)
    return simplex[index], evaluations
