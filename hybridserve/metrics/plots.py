"""PNG plots of simulated runs (matplotlib, Agg backend): latency CDFs, goodput, a timeline.

matplotlib is an optional dependency (the `sim` extra, installed by `make run` and `make test`);
without it the commands still write report.json and say the plots were skipped. A run is
anything shaped like `hybridserve.sim.run.SimRun` (`PlottedRun`): this layer does not import
the simulator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from hybridserve.metrics.recorder import MetricsRecorder

COLORS = {
    "baseline": "#7f7f7f",
    "hybridserve": "#d62728",
    "decode-first": "#9467bd",
    "controls-only": "#1f77b4",
    "retention-only": "#2ca02c",
}

# The p99 ITL SLO the shipped preset was selected under (docs/e1.md); marked on the ITL CDF.
ITL_SLO_MS = 100.0


class RunWindow(Protocol):
    @property
    def warmup_s(self) -> float: ...


class PlottedRun(Protocol):
    """What the plots read of a run: its window summary, recorder and warm-up."""

    @property
    def config(self) -> RunWindow: ...

    @property
    def summary(self) -> Mapping[str, float]: ...

    @property
    def recorder(self) -> MetricsRecorder: ...

    def ttft_samples_s(self) -> list[float]: ...

    def itl_samples_s(self) -> list[float]: ...


def plots_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(
    folder: Path, runs: Mapping[str, PlottedRun], *, itl_slo_ms: float | None = ITL_SLO_MS
) -> list[Path]:
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

    itl = {k: r.itl_samples_s() for k, r in runs.items()}
    ttft = {k: r.ttft_samples_s() for k, r in runs.items()}
    save(_cdf_figure(plt, "Inter-token latency", "ms", 1000.0, itl, itl_slo_ms), "itl_cdf.png")
    save(_cdf_figure(plt, "Time to first token", "s", 1.0, ttft, None), "ttft_cdf.png")
    save(_goodput_figure(plt, runs), "goodput.png")
    save(_timeline_figure(plt, runs), "timeline.png")
    return paths


def _cdf_figure(
    plt: Any,
    title: str,
    unit: str,
    scale: float,
    samples: Mapping[str, Sequence[float]],
    slo: float | None,
) -> Any:
    """Two panels: the whole CDF and its tail (p90 to p100), log x, the SLO marked if given."""
    fig, (whole, tail) = plt.subplots(1, 2, figsize=(11.0, 4.2))
    for label, values in samples.items():
        _cdf_panels(whole, tail, [scale * v for v in values], label, COLORS.get(label))
    for ax, what in ((whole, "all samples"), (tail, "tail: p90 to p100")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{title.lower()} ({unit}, log scale)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{title} CDF, {what}")
        ax.grid(True, which="both", alpha=0.3)
        if slo is not None:
            ax.axvline(slo, color="black", ls="--", lw=1.0, label=f"SLO {slo:g} {unit}")
    tail.set_ylim(0.9, 1.001)
    whole.legend(fontsize="small", loc="lower right")
    tail.legend(fontsize="small", loc="lower right")
    return fig


def _goodput_figure(plt: Any, runs: Mapping[str, PlottedRun]) -> Any:
    """Job goodput per run (output tokens per second when no run completed a job)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    labels = list(runs)
    jobs = any(runs[k].summary["job_goodput_per_hour"] for k in labels)
    key, ylabel, ptitle = (
        ("job_goodput_per_hour", "jobs completed per hour", "Job goodput")
        if jobs
        else ("output_tokens_per_s", "output tokens per second", "Output throughput")
    )
    values = [runs[k].summary[key] for k in labels]
    ax.bar(labels, values, color=[COLORS.get(k, "#9467bd") for k in labels])
    for x, value in enumerate(values):
        ax.annotate(f"{value:,.1f}", (x, value), ha="center", va="bottom")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{ptitle} (measurement window)")
    return fig


def _timeline_figure(plt: Any, runs: Mapping[str, PlottedRun]) -> Any:
    """One panel per run: prefill and decode tokens per step, KV usage on the right axis."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(9.0, 2.8 * len(runs)), sharex=True)
    axes_list: Sequence[Any] = axes if len(runs) > 1 else [axes]
    for ax, (label, run) in zip(axes_list, runs.items(), strict=True):
        rows = run.recorder.timeline.rows()
        t = [r["t_s"] for r in rows]
        lines = ax.plot(t, [r["prefill_tokens_per_step"] for r in rows], label="prefill tokens")
        lines += ax.plot(t, [r["decode_tokens_per_step"] for r in rows], label="decode tokens")
        ax.set_ylabel("tokens per step\n(mean over 1 s)")
        twin = ax.twinx()
        lines += twin.plot(
            t,
            [r["kv_usage_max"] for r in rows],
            color="black",
            alpha=0.4,
            lw=0.8,
            label="KV usage (right axis)",
        )
        twin.set_ylim(0, 1.05)
        twin.set_ylabel("KV pool used\n(max over 1 s)")
        warmup = run.config.warmup_s
        if warmup > 0:
            ax.axvspan(0, warmup, color="grey", alpha=0.12, lw=0)
            lines.append(ax.axvline(warmup, color="grey", ls=":", label="end of warm-up"))
        ax.set_title(f"{label}: prefill and decode per step, KV usage")
        ax.legend(lines, [line.get_label() for line in lines], loc="upper left", fontsize="small")
    axes_list[-1].set_xlabel("simulated seconds")
    return fig


def _cdf_panels(
    whole: Any, tail: Any, values: Sequence[float], label: str, color: str | None
) -> None:
    """One run's CDF on both panels, its p50 and p99 marked (a dot on the curve, in the
    legend with their values)."""
    from hybridserve.metrics.stats import percentile

    xs, ys = _cdf(values)
    if not xs:
        return
    p50, p99 = percentile(xs, 50), percentile(xs, 99)
    for ax in (whole, tail):
        (line,) = ax.plot(xs, ys, color=color, label=f"{label} (p50 {p50:.3g}, p99 {p99:.3g})")
        ax.plot([p50, p99], [0.5, 0.99], "o", color=line.get_color(), ms=4)


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(v for v in values if v > 0)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]


def write_fleet_sweep_plot(path: Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """fleet_sweep.png from a fleet sweep's rows (hybridserve.sim.fleet_sweep.row): on the
    left, goodput at the SLO per GPU against GPUs, a line per router (one colour each) and
    layout (colocated solid; disaggregated dashed, each point's P:D marked) and preset; on the
    right, each router's hit rate at the colocated points against GPUs, the global ideal
    dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (goodput, hits) = plt.subplots(1, 2, figsize=(12.0, 6.0))
    routers = list(dict.fromkeys(r["router"] for r in rows))
    colour = {name: f"C{i % 10}" for i, name in enumerate(routers)}
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    lines: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        kind = "colocated" if r["layout"] == "colocated" else "disaggregated"
        lines.setdefault((r["router"], kind, r["preset"]), []).append(r)
    for (router, kind, preset), points in lines.items():
        points = sorted(points, key=lambda r: r["gpus"])
        label = f"{router}, {kind}" + (f", {preset}" if len(presets) > 1 else "")
        marker = "o" if kind == "colocated" else "s"
        dash = ("-" if kind == "colocated" else "--") if presets.index(preset) == 0 else ":"
        xs = [r["gpus"] for r in points]
        ys = [_value(r["slo_requests_per_gpu_hour"]) for r in points]
        goodput.plot(xs, ys, marker=marker, ls=dash, color=colour[router], label=label)
        if kind == "disaggregated":
            for r, x, y in zip(points, xs, ys, strict=True):
                goodput.annotate(
                    r["layout"],
                    (x, y),
                    xytext=(4, 4),
                    textcoords="offset points",
                    fontsize="x-small",
                    color=colour[router],
                )
    gpus = sorted({r["gpus"] for r in rows})
    goodput.set_xticks(gpus)
    goodput.set_xlabel("GPUs (replicas x TP)")
    goodput.set_ylabel("requests within the SLO per GPU-hour")
    goodput.set_title("Goodput per GPU at the SLO (TTFT <= 15 s, p99 gap <= 100 ms)")
    goodput.set_ylim(bottom=0)
    goodput.grid(True, alpha=0.3)
    goodput.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    colocated = [r for r in rows if r["layout"] == "colocated" and r["preset"] == presets[0]]
    for router in dict.fromkeys(r["router"] for r in colocated):
        points = sorted((r for r in colocated if r["router"] == router), key=lambda r: r["gpus"])
        xs = [r["gpus"] for r in points]
        ys = [_value(r["hit_rate"]) for r in points]
        hits.plot(xs, ys, "-o", color=colour[router], label=router)
    by_gpus: dict[int, list[float]] = {}
    for r in colocated:
        by_gpus.setdefault(r["gpus"], []).append(_value(r["global_ideal_hit_rate"]))
    if by_gpus:
        xs = sorted(by_gpus)
        ideal = [sum(by_gpus[x]) / len(by_gpus[x]) for x in xs]
        hits.plot(xs, ideal, "k--", label="global ideal (one infinite cache)")
        hits.set_xticks(xs)
    hits.set_xlabel("GPUs (replicas x TP), colocated")
    hits.set_ylabel("prompt tokens hit / prompt tokens")
    suffix = f" ({presets[0]})" if len(presets) > 1 else ""
    hits.set_title(f"Hit rate per router against the global ideal{suffix}")
    hits.grid(True, alpha=0.3)
    hits.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _value(value: Any) -> float:
    """A row's value as a float (an undefined one, None, is NaN: a gap in the line)."""
    return float("nan") if value is None else float(value)
