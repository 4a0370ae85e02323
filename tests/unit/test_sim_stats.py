"""Paired ratios over seeds: geometric mean, log-scale t interval, degenerate and unusable seeds."""

from __future__ import annotations

import json
import math

import pytest

from hybridserve.sim.stats import describe_ratio, mean_ci95, paired_ratio, t975


def test_the_geometric_mean_calls_a_doubling_and_a_halving_a_wash() -> None:
    ratio = paired_ratio([2.0, 1.0], [1.0, 2.0])
    assert ratio["mean"] == 1.0  # the arithmetic mean of 2 and 0.5 would say 1.25
    assert ratio["per_seed"] == [2.0, 0.5]
    assert ratio["n"] == 2 and ratio["usable"] == 2 and ratio["degenerate"] is False


def test_the_interval_is_a_t_interval_on_the_log_scale() -> None:
    ratio = paired_ratio([1.0, 2.0, 4.0], [1.0, 1.0, 1.0])
    assert ratio["mean"] == pytest.approx(2.0, abs=1e-4)
    # Logs 0, ln 2, 2 ln 2: mean ln 2, sd ln 2; t(0.975, 2) = 4.302653 (any t table).
    half = 4.302653 * math.log(2) / math.sqrt(3)
    assert ratio["ci95"] == pytest.approx([2 * math.exp(-half), 2 * math.exp(half)], abs=1e-4)
    assert ratio["ci95"] == pytest.approx([0.3575, 11.19], abs=1e-4)
    assert describe_ratio(ratio) == "2.00x [0.36, 11.19], 3 seeds"


def test_t_quantiles_come_from_the_t_distribution() -> None:
    assert t975(2) == pytest.approx(4.302653, abs=1e-6)
    assert t975(40) == pytest.approx(2.021075, abs=1e-6)  # not the normal 1.96
    with pytest.raises(ValueError, match="two values"):
        t975(0)
    mean, ci = mean_ci95([1.0, 2.0, 3.0])
    assert mean == 2.0
    assert ci == pytest.approx((2.0 - 4.302653 / math.sqrt(3), 2.0 + 4.302653 / math.sqrt(3)))


def test_equal_ratios_on_every_seed_are_a_degenerate_interval_not_an_exact_one() -> None:
    ratio = paired_ratio([10.0, 12.0, 14.0], [10.0, 12.0, 14.0])
    assert ratio["mean"] == 1.0 and ratio["ci95"] == [1.0, 1.0]
    assert ratio["degenerate"] is True
    assert describe_ratio(ratio) == "1.00x (degenerate: every seed equal), 3 seeds"
    assert paired_ratio([3.0], [3.0])["degenerate"] is False  # one seed: no interval at all


def test_zero_or_missing_values_are_not_usable_and_never_nan() -> None:
    ratio = paired_ratio([1.0, 0.0, 3.0, None, math.nan], [0.0, 2.0, 1.0, 1.0, 1.0])
    assert ratio["per_seed"] == [None, None, 3.0, None, None]
    assert ratio["usable"] == 1 and ratio["n"] == 5
    assert ratio["mean"] == 3.0 and ratio["ci95"] is None
    assert describe_ratio(ratio) == "3.00x (one seed: no interval), 1 of 5 seeds usable"
    none = paired_ratio([0.0, 0.0], [0.0, 1.0])
    assert none["mean"] is None and none["ci95"] is None and none["usable"] == 0
    assert describe_ratio(none) == "n/a (no usable seed)"
    assert "NaN" not in json.dumps([ratio, none])


def test_unpaired_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="pair"):
        paired_ratio([1.0], [1.0, 2.0])


def test_goodput_ratios_pair_every_configuration_with_the_baseline() -> None:
    from hybridserve.sim.experiment import goodput_ratios

    key = "per_seed_job_goodput_per_hour"
    report = {
        "baseline": {key: [100.0, 200.0]},
        "hybridserve": {key: [200.0, 100.0]},
        "free-prefill": {key: [400.0, 800.0]},
        "setup": {"seeds": [0, 1]},
    }
    ratios = goodput_ratios(report)
    assert set(ratios) == {"hybridserve", "free-prefill"}
    assert ratios["hybridserve"]["mean"] == 1.0 and ratios["hybridserve"]["per_seed"] == [2.0, 0.5]
    assert ratios["free-prefill"]["degenerate"] is True and ratios["free-prefill"]["mean"] == 4.0
    assert goodput_ratios({"hybridserve": {key: [1.0]}}) == {}


def test_the_bench_prints_ratios_in_words() -> None:
    from rich.console import Console

    from hybridserve.cli.sim_commands import _print_ratios

    console = Console(record=True, width=200)
    same = paired_ratio([10.0, 12.0, 14.0], [10.0, 12.0, 14.0])
    report = {
        "setup": {"seeds": [0, 1, 2], "baseline": "vllm"},
        "ratios": {"job_goodput": same, "itl_p99": paired_ratio([1.0, 2.0, 4.0], [1.0] * 3)},
        "ratios_vs": {"legacy": {"job_goodput": paired_ratio([0.0, 0.0, 0.0], [1.0] * 3)}},
    }
    _print_ratios(console, report)
    text = console.export_text()
    assert "vllm job_goodput: 1.00x (degenerate: every seed equal), 3 seeds" in text
    assert "vllm itl_p99: 2.00x [0.36, 11.19], 3 seeds; per seed 1.00, 2.00, 4.00" in text
    assert "hybridserve / legacy: job_goodput n/a (no usable seed)" in text
