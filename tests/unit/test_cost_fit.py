"""Fitting Efficiency constants to measured step times (hybridserve.sim.fit)."""

from __future__ import annotations

import statistics

import pytest

from hybridserve.core.errors import ConfigError
from hybridserve.sim.cost_model import Efficiency, StepShape
from hybridserve.sim.fit import CostSetup, Sample, fit_efficiency, nelder_mead, objective
from hybridserve.sim.gpus import get_gpu
from hybridserve.sim.model_profiles import get_model

TRUE = Efficiency(gemm=0.55, attention=0.35, hbm=0.72, step_overhead_s=2.5e-3)
SETUP = CostSetup(gpu=get_gpu("H100-SXM"), model=get_model("llama-3.1-8b"))


def _shapes() -> list[StepShape]:
    """Steps that pin each constant: compute-bound prefills (gemm), long-context prefills
    (attention), large-batch decodes (hbm) and tiny decodes (overhead)."""
    shapes = [StepShape.prefill(n) for n in (2048, 4096, 8192)]
    shapes += [StepShape.prefill(4096, context_tokens=c) for c in (16_000, 60_000)]
    shapes += [StepShape.decode(batch=b, context_tokens=2_000) for b in (1, 8, 64, 256)]
    shapes += [StepShape.decode(batch=32, context_tokens=c) for c in (8_000, 30_000)]
    return shapes


def _samples(efficiency: Efficiency) -> list[Sample]:
    model = SETUP.cost_model(efficiency)
    return [Sample.of(SETUP, s, model.step_cost(s).total_s) for s in _shapes()]


def test_fit_recovers_the_constants_that_generated_the_samples() -> None:
    result = fit_efficiency(_samples(TRUE), max_evaluations=1500, tolerance=1e-12)
    fitted = result.efficiency
    for name in ("gemm", "attention", "hbm", "step_overhead_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=0.03), name
    assert statistics.median(abs(e) for e in result.relative_errors) < 0.01
    assert max(abs(e) for e in result.relative_errors) < 0.02


def test_fit_lowers_the_error_of_the_starting_constants() -> None:
    samples = _samples(TRUE)
    result = fit_efficiency(samples, max_evaluations=300)
    assert result.objective < objective(samples, Efficiency()) / 5
    assert 0 < result.efficiency.gemm <= 1 and result.efficiency.step_overhead_s >= 0


def test_weighted_sample_predicts_the_sum_of_its_steps() -> None:
    decode = StepShape.decode(batch=16, context_tokens=1_000)
    one = Sample.of(SETUP, decode, 1.0).predicted_s(TRUE)
    many = Sample(setup=SETUP, steps=((decode, 100.0),), measured_s=1.0).predicted_s(TRUE)
    assert many == pytest.approx(100 * one)


def test_fit_rejects_unknown_parameters_and_empty_samples() -> None:
    with pytest.raises(ConfigError, match="params"):
        fit_efficiency(_samples(TRUE), params=("gemm", "magic"))
    with pytest.raises(ConfigError, match="samples"):
        fit_efficiency([])
    with pytest.raises(ConfigError, match="measured_s"):
        Sample.of(SETUP, StepShape.prefill(16), 0.0)


def test_nelder_mead_finds_the_minimum_of_a_quadratic() -> None:
    best, evaluations = nelder_mead(
        lambda p: (p[0] - 1.5) ** 2 + 3 * (p[1] + 0.5) ** 2, [0.0, 0.0], tolerance=1e-14
    )
    assert best[0] == pytest.approx(1.5, abs=1e-3)
    assert best[1] == pytest.approx(-0.5, abs=1e-3)
    assert evaluations < 400


def test_bounded_fit_keeps_fractions_below_their_upper_bounds() -> None:
    samples = _samples(TRUE)
    result = fit_efficiency(samples, upper={"hbm": 0.6, "gemm": 0.5}, max_evaluations=400)
    assert result.efficiency.hbm <= 0.6 and result.efficiency.gemm <= 0.5
    assert result.efficiency.hbm == pytest.approx(0.6, rel=0.05)  # the truth (0.72) is above
    with pytest.raises(ConfigError, match=r"upper\.hbm"):
        fit_efficiency(samples, upper={"hbm": 1.5})
