"""E1 load curves: job goodput, p99 ITL and SLO attainment against the number of agents, for each
configuration, over paired seeds with Student-t 95% intervals.

SLO attainment is the fraction of turns (requests finished in the window) whose TTFT is at most
15 s and whose own p99 time between tokens is at most 100 ms (the tiers of DESIGN.md section 6).
Prints one JSON object (with the paired per-seed ratios of each configuration to the baseline)
and writes goodput_vs_agents.png, itl_p99_vs_agents.png, slo_vs_agents.png and
goodput_ratio_vs_agents.png (matplotlib) to --out. `--replot FILE` redraws them from a saved run
(into --out, with the recomputed JSON as load_curves.json).

Default: agents 5, 10, 20, 40, 80 x (baseline, hybridserve) x 3 seeds, 600 s runs with a 120 s
warm-up: 30 simulations, 7 minutes of CPU; 28 minutes of wall time with --workers 2 on this
project's 2-core machine while other work loaded it (the 40- and 80-agent runs take most of it).
`--tuned FILE` adds a third curve, `vllm-tuned`: the baseline preset with the vLLM setting of a
stored search (`hybridserve sweep --space vllm --json`), the same setting at every load.

    python benchmarks/load_curves.py --workers 2 --out runs/load_curves \
        --tuned docs/sweep_vllm_e1_20_agents.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from hybridserve.metrics.plots import COLORS, seeds_caption
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.experiment import baseline_preset, read_tuned, run_configs
from hybridserve.sim.run import with_preset
from hybridserve.sim.stats import mean_ci95, paired_ratio
from hybridserve.sim.workload import AgentParams

CURVES = (
    ("job_goodput_per_hour", "job goodput (jobs/h)", "goodput_vs_agents.png"),
    ("itl_p99_ms", "p99 ITL (ms)", "itl_p99_vs_agents.png"),
    ("slo_attainment", "turns meeting TTFT <= 15 s and p99 TBT <= 100 ms", "slo_vs_agents.png"),
)


def curve_point(values: list[float | None]) -> dict[str, Any]:
    """Mean and 95% t interval of the values that exist (None: a seed without a value, e.g. a
    ratio over a baseline that finished nothing), with every seed's value."""
    present = [v for v in values if v is not None]
    mean, ci = mean_ci95(present) if present else (math.nan, None)
    return {
        "mean": None if math.isnan(mean) else round(mean, 4),
        "ci95": None if ci is None else [round(ci[0], 4), round(ci[1], 4)],
        "per_seed": [None if v is None else round(v, 4) for v in values],
    }


RATIO_KEYS = ("job_goodput_per_hour", "itl_p99_ms")
RATIO_PNG = "goodput_ratio_vs_agents.png"


def paired_ratios(
    curves: dict[str, dict[str, dict[str, Any]]], agents: list[int]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per configuration but the baseline, per agent count: the per-seed ratios configuration /
    baseline of job goodput and p99 ITL (the seeds are paired), their geometric mean and 95% t
    interval on the log scale (hybridserve.sim.stats.paired_ratio)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for label, by_agents in curves.items():
        if label == "baseline":
            continue
        out[label] = {}
        for a in agents:
            point = {}
            for key in RATIO_KEYS:
                ours = by_agents[str(a)][key]["per_seed"]
                base = curves["baseline"][str(a)][key]["per_seed"]
                point[key] = paired_ratio(ours, base)
            out[label][str(a)] = point
    return out


def _draw(
    series: dict[str, list[dict[str, Any]]],
    agents: list[int],
    path: Path,
    *,
    ylabel: str,
    title: str,
    unity: bool = False,
) -> str:
    """One PNG: a line per series over the agent counts, with each point's 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, points in series.items():
        means = [math.nan if p["mean"] is None else p["mean"] for p in points]
        low = [m - (p["ci95"][0] if p["ci95"] else m) for m, p in zip(means, points, strict=True)]
        high = [(p["ci95"][1] if p["ci95"] else m) - m for m, p in zip(means, points, strict=True)]
        colour = COLORS.get(label)
        ax.errorbar(
            agents, means, yerr=[low, high], marker="o", capsize=3, label=label, color=colour
        )
    if unity:
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(agents, [str(a) for a in agents])
    ax.set_xlabel("agents")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def plot_ratios(
    ratios: dict[str, dict[str, dict[str, Any]]], agents: list[int], out: Path, seeds: list[int]
) -> str:
    """One PNG: job goodput over the baseline's, per configuration, with paired intervals."""
    series = {
        label: [by_agents[str(a)]["job_goodput_per_hour"] for a in agents]
        for label, by_agents in ratios.items()
    }
    return _draw(
        series,
        agents,
        out / RATIO_PNG,
        ylabel="job goodput / baseline's (same seed)",
        title="paired job goodput ratio vs load\n"
        f"({seeds_caption(seeds, mean='geometric mean')}, 95% t interval)",
        unity=True,
    )


def plot(
    curves: dict[str, dict[str, dict[str, Any]]], agents: list[int], out: Path, seeds: list[int]
) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key, label, name in CURVES:
        series = {
            config: [by_agents[str(a)][key] for a in agents] for config, by_agents in curves.items()
        }
        title = f"{label} vs load ({seeds_caption(seeds)}, 95% CI)"
        written.append(_draw(series, agents, out / name, ylabel=label, title=title))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[5, 10, 20, 40, 80])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--baseline", default="vllm", help="vllm or legacy")
    parser.add_argument(
        "--tuned",
        type=Path,
        default=None,
        help="add a vllm-tuned curve: the setting of this search (sweep --space vllm --json)",
    )
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--warmup", type=float, default=120.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/load_curves"))
    parser.add_argument(
        "--replot",
        type=Path,
        default=None,
        help="redraw the PNGs and recompute the ratios from an earlier run's JSON into --out "
        "(with load_curves.json); runs nothing",
    )
    args = parser.parse_args()
    if args.replot is not None:
        saved = json.loads(args.replot.read_text())
        agents = [int(a) for a in next(iter(saved["curves"].values()))]
        report = _report(saved["setup"], saved["curves"], agents, args.out)
        (args.out / "load_curves.json").write_text(json.dumps(report) + "\n")
        print(json.dumps(report))
        return
    if args.baseline == "vllm-tuned":
        parser.error("--baseline: use vllm or legacy; --tuned FILE adds the vllm-tuned curve")
    seeds = list(range(args.seeds))
    presets = {"baseline": baseline_preset(args.baseline), "hybridserve": "hybridserve"}
    configs = {}
    search = None
    for agents in args.agents:
        base = SimConfig(
            agents=AgentParams(num_agents=agents),
            duration_s=args.duration,
            warmup_s=args.warmup,
        )
        for label, preset in presets.items():
            configs[f"{label}@{agents}"] = with_preset(base, preset)
        if args.tuned is not None:
            tuned, search = read_tuned(with_preset(base, "baseline"), args.tuned)
            configs[f"vllm-tuned@{agents}"] = tuned
    if args.tuned is not None:
        presets["vllm-tuned"] = "baseline"
    results, _ = run_configs(
        configs, seeds, workers=args.workers, log=lambda line: print(line, file=sys.stderr)
    )
    curves: dict[str, dict[str, dict[str, Any]]] = {label: {} for label in presets}
    for label in presets:
        for agents in args.agents:
            rows = results[f"{label}@{agents}"]
            curves[label][str(agents)] = {
                key: curve_point([r[key] for r in rows]) for key, _, _ in CURVES
            }
    setup = {"baseline": args.baseline, "seeds": seeds, "duration_s": args.duration}
    setup["warmup_s"] = args.warmup
    setup["vllm_tuned"] = search
    print(json.dumps(_report(setup, curves, args.agents, args.out)))


def _report(
    setup: dict[str, Any],
    curves: dict[str, dict[str, dict[str, Any]]],
    agents: list[int],
    out: Path,
) -> dict[str, Any]:
    """The printed JSON: setup, curves, paired ratios, and the PNGs drawn into `out`."""
    ratios = paired_ratios(curves, agents)
    seeds = [int(s) for s in setup["seeds"]]
    files = plot(curves, agents, out, seeds)
    files.append(plot_ratios(ratios, agents, out, seeds))
    return {"setup": setup, "curves": curves, "ratios": ratios, "files": files}


if __name__ == "__main__":
    main()
