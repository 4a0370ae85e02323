"""PNG plots of simulated runs (matplotlib, Agg backend): latency CDFs, goodput, a timeline.

matplotlib is an optional dependency (the `sim` extra, installed by `make run` and `make test`);
without it the commands still write report.json and say the plots were skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridserve.sim.run import SimRun

COLORS = {
    "baseline": "#7f7f7f",
    "hybridserve": "#d62728",
    "controls-only": "#1f77b4",
    "retention-only": "#2ca02c",
}


def plots_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(folder: Path, runs: Mapping[str, SimRun]) -> list[Path]:
    """Write itl_cdf.png, ttft_cdf.png, goodput.png and timeline.png; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = folder / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    for name, title, samples in (
        ("itl_cdf.png", "Inter-token latency", {k: r.itl_samples_s() for k, r in runs.items()}),
        ("ttft_cdf.png", "Time to first token", {k: r.ttft_samples_s() for k, r in runs.items()}),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for label, values in samples.items():
            xs, ys = _cdf([1000 * v for v in values])
            ax.plot(xs, ys, label=label, color=COLORS.get(label))
        ax.set_xscale("log")
        ax.set_xlabel("ms (log scale)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{title} CDF (measurement window)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        save(fig, name)

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    labels = list(runs)
    goodput = [runs[k].summary["job_goodput_per_hour"] for k in labels]
    ax.bar(labels, goodput, color=[COLORS.get(k, "#9467bd") for k in labels])
    for x, value in enumerate(goodput):
        ax.annotate(f"{value:.1f}", (x, value), ha="center", va="bottom")
    ax.set_ylabel("jobs completed per hour")
    ax.set_title("Job goodput")
    save(fig, "goodput.png")

    fig, axes = plt.subplots(len(runs), 1, figsize=(8.0, 2.4 * len(runs)), sharex=True)
    axes_list: Sequence[Any] = axes if len(runs) > 1 else [axes]
    for ax, (label, run) in zip(axes_list, runs.items(), strict=True):
        rows = run.recorder.timeline.rows()
        t = [r["t_s"] for r in rows]
        ax.plot(t, [r["prefill_tokens_per_step"] for r in rows], label="prefill tokens/step")
        ax.plot(t, [r["decode_tokens_per_step"] for r in rows], label="decode tokens/step")
        twin = ax.twinx()
        twin.plot(t, [r["kv_usage_max"] for r in rows], color="black", alpha=0.3, lw=0.8)
        twin.set_ylim(0, 1.05)
        twin.set_ylabel("KV usage")
        ax.set_ylabel("tokens per step")
        ax.set_title(label)
        ax.legend(loc="upper left", fontsize="small")
    axes_list[-1].set_xlabel("simulated seconds")
    save(fig, "timeline.png")
    return paths


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(v for v in values if v > 0)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]
