"""Paired comparisons over seeds: the mean of per-seed ratios with a Student-t 95% interval."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

# Two-sided 95% Student-t quantiles t(0.975, df) for df = 1..30 (any statistics table, e.g.
# NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.2); above 30 the normal 1.96
# is within 2%.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    """t(0.975, df); raises ValueError for df < 1."""
    if df < 1:
        raise ValueError(f"df={df}: a t interval needs at least two values")
    return _T975[df - 1] if df <= len(_T975) else 1.96


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


def paired_ratio(ours: Sequence[float], base: Sequence[float]) -> dict[str, object]:
    """Per-seed ratios ours[i] / base[i] (paired: same seed, same jobs), their mean and the 95%
    t interval of the mean: {"mean", "ci95", "per_seed", "n"}."""
    if len(ours) != len(base):
        raise ValueError(f"{len(ours)} values against {len(base)}: pair them by seed")
    ratios = [o / b if b else math.nan for o, b in zip(ours, base, strict=True)]
    mean, ci = mean_ci95(ratios)
    return {
        "mean": _round(mean),
        "ci95": None if ci is None else [_round(ci[0]), _round(ci[1])],
        "per_seed": [_round(r) for r in ratios],
        "n": len(ratios),
    }


def _round(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)
