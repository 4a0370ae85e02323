"""Paired comparisons over seeds: the geometric mean of per-seed ratios with a Student-t 95%
interval on the log scale.

A ratio ours / base is multiplicative, so the mean is taken of log ratios and exponentiated:
ratios 2 and 0.5 average to 1.0 (their arithmetic mean, 1.25, would call a wash a win). The t
quantile comes from scipy (the `sim` extra), imported when an interval is computed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any


def t975(df: int) -> float:
    """The two-sided 95% Student-t quantile t(0.975, df); raises ValueError for df < 1."""
    if df < 1:
        raise ValueError(f"df={df}: a t interval needs at least two values")
    try:
        from scipy.stats import t
    except ImportError as exc:
        raise ImportError(
            "scipy is not installed: the 95% intervals need its t quantiles "
            "(pip install 'hybridserve[sim]')"
        ) from exc
    return float(t.ppf(0.975, df))


def mean_ci95(values: Sequence[float]) -> tuple[float, tuple[float, float] | None]:
    """The mean and its 95% t interval; None for the interval with fewer than two values."""
    clean = [v for v in values if not math.isnan(v)]
    if not clean:
        return math.nan, None
    mean = statistics.fmean(clean)
    if len(clean) < 2:
        return mean, None
    half = t975(len(clean) - 1) * statistics.stdev(clean) / math.sqrt(len(clean))
    return mean, (mean - half, mean + half)


def paired_ratio(ours: Sequence[float | None], base: Sequence[float | None]) -> dict[str, Any]:
    """Per-seed ratios ours[i] / base[i] (paired: same seed, same jobs), their geometric mean
    and its 95% t interval on the log scale: {"mean", "ci95", "per_seed", "n", "usable",
    "degenerate"}.

    A seed is usable when its ratio is finite and > 0 (a zero, missing or non-finite value on
    either side is not: its per-seed entry is None). `mean` and `ci95` are None without a
    usable seed; `ci95` is None with one. `degenerate` is True when two or more usable seeds
    all have the same ratio (equal job counts, say): the interval is then [r, r], which says
    nothing about the spread the seeds would show, not that the ratio is exact."""
    if len(ours) != len(base):
        raise ValueError(f"{len(ours)} values against {len(base)}: pair them by seed")
    ratios = [_ratio(o, b) for o, b in zip(ours, base, strict=True)]
    logs = [math.log(r) for r in ratios if r is not None]
    mean: float | None = None
    ci: list[float | None] | None = None
    degenerate = False
    if logs:
        centre = statistics.fmean(logs)
        mean = _round(math.exp(centre))
        if len(logs) >= 2:
            usable = [r for r in ratios if r is not None]
            degenerate = all(r == usable[0] for r in usable)
            if degenerate:
                ci = [_round(usable[0]), _round(usable[0])]
            else:
                half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
                ci = [_round(math.exp(centre - half)), _round(math.exp(centre + half))]
    return {
        "mean": mean,
        "ci95": ci,
        "per_seed": [None if r is None else _round(r) for r in ratios],
        "n": len(ratios),
        "usable": len(logs),
        "degenerate": degenerate,
    }


def describe_ratio(ratio: Mapping[str, Any]) -> str:
    """A paired ratio in words: "1.62x [1.41, 1.86], 3 seeds", "1.00x (degenerate: every seed
    equal), 3 seeds", "1.20x (one seed: no interval), 1 seed" or "n/a (no usable seed)"."""
    mean = ratio.get("mean")
    usable = int(ratio.get("usable", ratio.get("n", 0)) or 0)
    if mean is None or usable == 0:
        return "n/a (no usable seed)"
    n = int(ratio.get("n", usable))
    seeds = f"{usable} seed{'s' if usable != 1 else ''}"
    if usable < n:
        seeds = f"{usable} of {n} seeds usable"
    ci = ratio.get("ci95")
    if ratio.get("degenerate"):
        return f"{mean:.2f}x (degenerate: every seed equal), {seeds}"
    if ci is None or ci[0] is None or ci[1] is None:
        return f"{mean:.2f}x (one seed: no interval), {seeds}"
    return f"{mean:.2f}x [{ci[0]:.2f}, {ci[1]:.2f}], {seeds}"


def _ratio(ours: float | None, base: float | None) -> float | None:
    if ours is None or base is None or not base:
        return None
    value = ours / base
    return value if math.isfinite(value) and value > 0 else None


def _round(value: float) -> float | None:
    return round(value, 4) if math.isfinite(value) else None
