"""PNG plots of simulated runs (matplotlib, Agg backend): latency CDFs, goodput, a timeline.

Every plot names the seeds it shows. Log axes carry plain tick labels (20, 50, 100, not 10^2).
The goodput plot of a comparison shows each configuration's paired ratio to the baseline (the
geometric mean over seeds, hybridserve.sim.stats.paired_ratio) with its 95% interval as an
error bar and the bounds as reference lines, rather than bars from zero.

matplotlib is an optional dependency (the `sim` extra, installed by `make run` and `make test`);
without it the commands still write report.json and say the plots were skipped. A run is
anything shaped like `hybridserve.sim.summary.SimRun` (`PlottedRun`): this layer does not import
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
    "vllm": "#17becf",
    "vllm-tuned": "#ff7f0e",
    "legacy": "#8c564b",
    "decode-first": "#9467bd",
    "controls-only": "#1f77b4",
    "retention-only": "#2ca02c",
    "free-prefill": "#bcbd22",
    "ideal-hits": "#e377c2",
    "infinite-engine": "#000000",
}
# Where goodput.png's log ratio axis puts its ticks when they fit (plain numbers).
RATIO_TICKS = (
    0.1, 0.2, 0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.75, 2.0, 2.5, 3.0,
    4.0, 5.0, 7.5, 10.0, 20.0, 50.0, 100.0,
)  # fmt: skip
# Configurations without a colour of their own (a --config file, say).
OTHER_COLOR = "#393b79"

# The p99 ITL SLO the shipped preset was selected under (docs/e1.md); marked on the ITL CDF.
ITL_SLO_MS = 100.0


class RunWindow(Protocol):
    @property
    def warmup_s(self) -> float: ...

    @property
    def seed(self) -> int: ...


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


def seeds_caption(seeds: Sequence[int], *, mean: str = "mean") -> str:
    """The seeds a plot shows, in words: "seed 0", "mean of seeds 0-2", "mean of seeds 1, 4"."""
    ordered = sorted(set(seeds))
    if not ordered:
        return "no seed"
    if len(ordered) == 1:
        return f"seed {ordered[0]}"
    contiguous = ordered == list(range(ordered[0], ordered[-1] + 1))
    listed = f"{ordered[0]}-{ordered[-1]}" if contiguous else ", ".join(str(s) for s in ordered)
    return f"{mean} of seeds {listed}"


def plain_log_ticks(axis: Any) -> None:
    """Plain numbers on a log axis: 0.5, 20, 1000 at the decades, 2 and 5 between them (not
    10^x, which matplotlib's log formatter writes)."""
    import math

    from matplotlib.ticker import FuncFormatter

    def major(value: float, _pos: int) -> str:
        return f"{value:g}" if value > 0 else ""

    def minor(value: float, _pos: int) -> str:
        if value <= 0:
            return ""
        lead = round(value / 10 ** math.floor(math.log10(value)), 6)
        return f"{value:g}" if lead in (2.0, 5.0) else ""

    axis.set_major_formatter(FuncFormatter(major))
    axis.set_minor_formatter(FuncFormatter(minor))


def write_plots(
    folder: Path,
    runs: Mapping[str, PlottedRun],
    *,
    itl_slo_ms: float | None = ITL_SLO_MS,
    goodput_ratios: Mapping[str, Mapping[str, Any]] | None = None,
    ratio_seeds: Sequence[int] = (),
    baseline: str = "baseline",
    bounds: Sequence[str] = (),
) -> list[Path]:
    """Write itl_cdf.png, ttft_cdf.png, goodput.png and timeline.png; return their paths.

    `goodput_ratios` (label -> paired ratio of its job goodput to `baseline`'s over
    `ratio_seeds`, the `bounds` among them drawn as reference lines) turns goodput.png into
    the paired ratios with their 95% intervals; without it goodput.png shows each run's own
    goodput. The CDFs and the timeline show the runs given, captioned with their seeds."""
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

    shown = seeds_caption([r.config.seed for r in runs.values()])
    itl = {k: r.itl_samples_s() for k, r in runs.items()}
    ttft = {k: r.ttft_samples_s() for k, r in runs.items()}
    itl_fig = _cdf_figure(plt, "Inter-token latency", "ms", 1000.0, itl, itl_slo_ms, shown)
    save(itl_fig, "itl_cdf.png")
    save(_cdf_figure(plt, "Time to first token", "s", 1.0, ttft, None, shown), "ttft_cdf.png")
    if goodput_ratios:
        save(_ratio_figure(plt, goodput_ratios, ratio_seeds, baseline, bounds), "goodput.png")
    else:
        save(_goodput_figure(plt, runs, shown), "goodput.png")
    save(_timeline_figure(plt, runs, shown), "timeline.png")
    return paths


def _cdf_figure(
    plt: Any,
    title: str,
    unit: str,
    scale: float,
    samples: Mapping[str, Sequence[float]],
    slo: float | None,
    shown: str,
) -> Any:
    """Two panels: the whole CDF and its tail (p90 to p100), log x, the SLO marked if given."""
    fig, (whole, tail) = plt.subplots(1, 2, figsize=(11.0, 4.4))
    for label, values in samples.items():
        _cdf_panels(whole, tail, [scale * v for v in values], label, _color(label))
    fig.suptitle(f"{title}: {shown}", fontsize="medium")
    for ax, what in ((whole, "all samples"), (tail, "tail: p90 to p100")):
        ax.set_xscale("log")
        plain_log_ticks(ax.xaxis)
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


def _color(label: str) -> str:
    return COLORS.get(label, OTHER_COLOR)


def _goodput_figure(plt: Any, runs: Mapping[str, PlottedRun], shown: str) -> Any:
    """Job goodput per run (output tokens per second when no run completed a job), one point
    each with its value: a run on its own, with no baseline to pair it with."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    labels = list(runs)
    jobs = any(runs[k].summary["job_goodput_per_hour"] for k in labels)
    key, ylabel, ptitle = (
        ("job_goodput_per_hour", "jobs completed per hour", "Job goodput")
        if jobs
        else ("output_tokens_per_s", "output tokens per second", "Output throughput")
    )
    values = [runs[k].summary[key] for k in labels]
    for x, (label, value) in enumerate(zip(labels, values, strict=True)):
        ax.plot([x], [value], "o", ms=8, color=_color(label))
        ax.annotate(
            f"{value:,.1f}", (x, value), xytext=(8, 0), textcoords="offset points", va="center"
        )
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlim(-0.5, len(labels) - 0.5)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{ptitle} (measurement window, {shown})")
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def _ratio_figure(
    plt: Any,
    ratios: Mapping[str, Mapping[str, Any]],
    seeds: Sequence[int],
    baseline: str,
    bounds: Sequence[str],
) -> Any:
    """Each configuration's paired job-goodput ratio to the baseline: the geometric mean over
    seeds as a point, its 95% interval as an error bar (a degenerate one, every seed equal,
    said so), the bounds as dashed reference lines at their own ratios, 1 marked; log y."""
    fig, ax = plt.subplots(figsize=(7.4, 4.6))
    configs = [k for k in ratios if k not in bounds and k != baseline]
    ax.axhline(1.0, color=_color("baseline"), lw=1.0, label=f"{baseline} (1x)")
    values: list[float] = [1.0]
    for x, label in enumerate(configs):
        ratio = ratios[label]
        mean = ratio.get("mean")
        if mean is None:
            ax.annotate("n/a", (x, 1.0), ha="center", va="bottom")
            continue
        ci = ratio.get("ci95")
        lo, hi = (mean, mean) if ci is None or None in ci else (ci[0], ci[1])
        values += [lo, hi]
        ax.errorbar(
            [x], [mean], yerr=[[mean - lo], [hi - mean]], fmt="o", ms=7, capsize=6,
            color=_color(label),
        )  # fmt: skip
        note = (
            "degenerate: every seed equal"
            if ratio.get("degenerate")
            else ("one seed: no interval" if ci is None else f"[{lo:.2f}, {hi:.2f}]")
        )
        ax.annotate(
            f"{mean:.2f}x\n{note}",
            (x, mean),
            xytext=(10, 0),
            textcoords="offset points",
            va="center",
            fontsize="small",
        )
    for label in (k for k in ratios if k in bounds):
        mean = ratios[label].get("mean")
        if mean is None:
            continue
        values.append(mean)
        ax.axhline(mean, color=_color(label), ls="--", lw=1.0, label=f"{label} bound {mean:.2f}x")
    ax.set_xticks(range(len(configs)), configs)
    ax.set_xlim(-0.5, max(len(configs), 1) - 0.5 + 0.6)
    ax.set_yscale("log")
    low, high = min(values) / 1.1, max(values) * 1.1
    ax.set_ylim(low, high)
    ticks = [v for v in RATIO_TICKS if low <= v <= high]
    if len(ticks) >= 3:  # a narrow range: ticks at round ratios, not only at 1, 2 and 5
        from matplotlib.ticker import NullLocator

        ax.set_yticks(ticks)
        ax.yaxis.set_minor_locator(NullLocator())
    plain_log_ticks(ax.yaxis)
    ax.set_ylabel(f"job goodput / {baseline}'s, same seed (log)")
    ax.set_title(
        f"Job goodput, paired ratio to {baseline}\n"
        f"(geometric {seeds_caption(seeds)}, 95% t interval)",
        fontsize="medium",
    )
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="best")
    return fig


def _timeline_figure(plt: Any, runs: Mapping[str, PlottedRun], shown: str) -> Any:
    """One panel per run: prefill and decode tokens per step, KV usage on the right axis; one
    y scale for all the panels, so their heights compare."""
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(9.0, 2.8 * len(runs) + 0.4), sharex=True, sharey=True
    )
    fig.suptitle(f"Timeline: {shown}", fontsize="medium")
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
        ax.set_title(f"{label}: prefill and decode per step, KV usage (seed {run.config.seed})")
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


def write_fleet_sweep_plot(
    path: Path, rows: Sequence[Mapping[str, Any]], *, seed: int | None = None
) -> Path:
    """fleet_sweep.png from a fleet sweep's rows (hybridserve.sim.fleet_sweep.row): on the
    left, goodput at the SLO per GPU against GPUs, a line per router (one colour each) and
    layout (colocated solid; disaggregated dashed, each point's P:D marked) and preset; on the
    right, each router's hit rate at the colocated points against GPUs, the global ideal
    dashed. `seed`, the seed every point ran on, is named in the figure's title."""
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
    if seed is not None:
        fig.suptitle(f"Fleet sweep: every point on {seeds_caption([seed])}", fontsize="medium")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _value(value: Any) -> float:
    """A row's value as a float (an undefined one, None, is NaN: a gap in the line)."""
    return float("nan") if value is None else float(value)
