"""The suite's summary plot: per row, each preset's goodput as a paired ratio to vLLM 0.33's
defaults and to the tuned vLLM, with 95% intervals, on a log axis with plain tick labels."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

_AGAINST = (("vllm", "vLLM 0.33 defaults", "#1f77b4"), ("vllm-tuned", "tuned vLLM", "#ff7f0e"))
_FLOOR, _CEIL = 0.02, 50.0  # where a ratio of 0 or one past the axis is drawn


def write_suite_plot(path: Path, report: dict[str, Any]) -> Path:
    """Write the plot of `report` (hybridserve.sim.suite.suite_report) to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    rows = [(name, row) for name, row in report["rows"].items() if "error" not in row]
    ours = list(report["summary"])
    fig, axes = plt.subplots(
        1, max(1, len(ours)), figsize=(7 * max(1, len(ours)), 0.42 * len(rows) + 1.8), sharey=True
    )
    axes = list(axes) if hasattr(axes, "__len__") else [axes]
    labels = [f"{name}{' *' if row['role'] == 'choose' else ''}" for name, row in rows]
    for ax, label in zip(axes, ours, strict=False):
        for offset, (against, text, colour) in zip((-0.17, 0.17), _AGAINST, strict=True):
            ys, xs, lo, hi = [], [], [], []
            for i, (_name, row) in enumerate(rows):
                ratio = row["ratios"][label][against]["goodput"]
                if ratio["mean"] is None:
                    continue
                mean = min(max(ratio["mean"], _FLOOR), _CEIL)
                ci = ratio["ci95"] or [ratio["mean"], ratio["mean"]]
                ys.append(i + offset)
                xs.append(mean)
                lo.append(mean - min(max(ci[0], _FLOOR), mean))
                hi.append(max(min(ci[1], _CEIL), mean) - mean)
            ax.errorbar(xs, ys, xerr=[lo, hi], fmt="o", color=colour, capsize=3, label=text)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.axvline(0.98, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(_plain))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda _v, _p: ""))
        ax.set_title(f"{label}: SLO goodput / baseline")
        ax.set_xlabel("paired ratio (geometric mean over seeds, 95% interval); dashed: 0.98")
        ax.legend(loc="lower right", fontsize=8)
    axes[0].set_yticks(range(len(rows)))
    axes[0].set_yticklabels(labels)
    axes[0].invert_yaxis()
    seeds = report["suite"]["seeds"]
    fig.suptitle(
        f"suite ({report['suite']['mode']}), seeds {seeds[0]}-{seeds[-1]} paired; "
        "* rows the preset was chosen on",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plain(value: float, _pos: object) -> str:
    if value <= 0 or not math.isfinite(value):
        return ""
    return f"{value:g}"
