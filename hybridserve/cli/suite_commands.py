"""`hybridserve suite`: one deployment over the workload suite, against vLLM 0.33."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from hybridserve.cli.app import FINITE_FLOAT, app, err, fail, install_hint, out_console
from hybridserve.cli.options import (
    FirstSeedOption,
    JsonOption,
    NameOption,
    SimGpuOption,
    SimModelOption,
    WorkersOption,
)
from hybridserve.cli.progress import interrupted, runs_progress
from hybridserve.core.errors import ConfigError, HybridServeError

if TYPE_CHECKING:
    from hybridserve.sim.deployment import SimConfig
    from hybridserve.sim.suite import Mode, SuiteRow

BOUND = "free-prefill"  # hybridserve.sim.suite.BOUND, without importing the simulator here

RowsOption = Annotated[
    str,
    typer.Option(
        help="Rows: all, choose (the rows the shipped preset is chosen on), report (the rows "
        "it is only checked on), or names separated by commas (see docs/suite.md)."
    ),
]
FullOption = Annotated[
    bool,
    typer.Option(
        "--full",
        help="The full suite (30-40 minute agent runs, 1,500-request traces; hours here) "
        "instead of the screen (shorter runs, under 10 minutes here with 2 seeds).",
    ),
]
SuitePresetsOption = Annotated[
    str,
    typer.Option(
        help="Presets to run beside vLLM's defaults and the tuned vLLM, comma-separated "
        "(e.g. hybridserve,adaptive)."
    ),
]
TunedSuiteOption = Annotated[
    Path | None,
    typer.Option(
        "--tuned",
        help="The tuned vLLM of every row: a `sweep --space vllm` JSON "
        "[default: docs/sweep_vllm_e1_20_agents.json].",
    ),
]
ScaleOption = Annotated[
    float,
    typer.Option(
        parser=FINITE_FLOAT,
        help="Multiply every run's duration, warm-up and trace requests (0.25: a quick look).",
    ),
]
SuiteSeedsOption = Annotated[int, typer.Option(help="Paired seeds per row.")]


@app.command("suite")
def suite_cmd(
    rows: RowsOption = "all",
    full: FullOption = False,
    presets: SuitePresetsOption = "hybridserve",
    seeds: SuiteSeedsOption = 2,
    seed: FirstSeedOption = 0,
    model: SimModelOption = "qwen3-next-80b-a3b",
    gpu: SimGpuOption = None,
    tuned: TunedSuiteOption = None,
    scale: ScaleOption = 1.0,
    workers: WorkersOption = 2,
    name: NameOption = None,
    as_json: JsonOption = False,
) -> None:
    """Run presets over the workload suite against vLLM 0.33's defaults and one tuned vLLM
    setting: per row, goodput under the SLO, p99 latencies and paired ratios with 95% intervals,
    and whether the row holds "never loses". Writes runs/NAME/report.json and suite.png."""
    from hybridserve.sim.suite import count_runs, run_suite, suite_report

    mode: Mode = "full" if full else "screen"
    try:
        chosen, configs, search = _setup(rows, presets, seeds, scale, workers, model, gpu, tuned)
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    seed_list = list(range(seed, seed + seeds))
    folder = _folder(name)
    total = count_runs(chosen, list(configs), seed_list)
    if not as_json:
        err.print(_intro(mode, len(chosen), list(configs), seed_list, total), soft_wrap=True)
    started = time.monotonic()
    try:
        with runs_progress(total, quiet=as_json) as log:
            results, errors = run_suite(
                chosen, configs, seed_list, mode=mode, scale=scale, workers=workers, log=log
            )
    except KeyboardInterrupt:
        raise interrupted("the suite did not finish; nothing was written") from None
    report = suite_report(chosen, configs, seed_list, results, errors, mode=mode, search=search)
    report["suite"]["scale"] = scale
    report["suite"]["wall_s"] = round(time.monotonic() - started, 1)
    files = _write(folder, report)
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        print_report(report, files)


def _setup(
    rows: str,
    presets: str,
    seeds: int,
    scale: float,
    workers: int,
    model: str,
    gpu: str | None,
    tuned: Path | None,
) -> tuple[list[SuiteRow], dict[str, SimConfig], dict[str, Any]]:
    """The rows and configurations the flags ask for, and the tuned search. Raises ConfigError
    naming the flag that is off."""
    from hybridserve.sim.deployment import SimConfig
    from hybridserve.sim.suite import TUNED, pick_rows, suite_configs

    if seeds < 2:
        raise ConfigError("--seeds", seeds, "paired ratios need 2 or more seeds")
    if not scale > 0:
        raise ConfigError("--scale", scale, "use a positive factor")
    if workers < 1:
        raise ConfigError("--workers", workers, "use 1 or more")
    chosen = pick_rows(rows)
    names = [p.strip() for p in presets.split(",") if p.strip()]
    base = SimConfig(model=model, gpu=gpu or "H200")
    bound = any(row.bounded for row in chosen)  # the bound runs only where a row has one
    configs, search = suite_configs(base, names, tuned or TUNED, bound=bound)
    return chosen, configs, search


def print_report(report: dict[str, Any], files: list[Path]) -> None:
    """The table, the per-preset summary lines and the files written, on stdout."""
    console = out_console()
    if not console.is_terminal:
        console.width = max(console.width, 180)  # a file or a pipe gets the whole table
    console.print(suite_table(report))
    for line in [*falloff_lines(report), *summary_lines(report)]:
        console.print(line, soft_wrap=True)
    console.print(f"files: {', '.join(str(f) for f in files)}", soft_wrap=True)


def _intro(mode: str, rows: int, configs: list[str], seeds: list[int], total: int) -> str:
    what = (
        "the screen: shorter runs than the full suite (--full, or benchmarks/suite.py)"
        if mode == "screen"
        else "the full suite"
    )
    return (
        f"suite ({what}): {rows} rows x {len(configs)} configurations ({', '.join(configs)}) "
        f"x seeds {seeds[0]}-{seeds[-1]} = {total} simulated runs"
        + (f" ({BOUND} on the agent rows only)" if BOUND in configs else "")
    )


def _folder(name: str | None) -> Path:
    if name is not None:
        return Path("runs") / name
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder, n = Path("runs") / f"suite-{stamp}", 1
    while folder.exists():
        n += 1
        folder = Path("runs") / f"suite-{stamp}-{n}"
    return folder


def _write(folder: Path, report: dict[str, Any]) -> list[Path]:
    from hybridserve.metrics.plots import plots_available

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    if not plots_available():
        err.print(f"plot skipped: matplotlib is not installed ({install_hint('sim')})")
        return [path]
    from hybridserve.metrics.suite_plot import write_suite_plot

    return [path, write_suite_plot(folder / "suite.png", report)]


def _ratio_cell(ratio: dict[str, Any] | None) -> str:
    if ratio is None or ratio.get("mean") is None:
        return "n/a"
    ci = ratio.get("ci95")
    band = f" [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else ""
    return f"{ratio['mean']:.2f}{band}"


def _value(metrics: dict[str, Any] | None, metric: str, *, share: bool) -> str:
    """A configuration's goodput on a row, with (`share`) its share of the bound where the row
    has one; "-" where the configuration did not run on the row (the bound off its rows)."""
    if metrics is None:
        return "-"
    value = metrics["goodput"]
    if value is None:
        return "n/a"
    text = f"{value:.1f}" if metric == "slo_jobs_per_hour" else f"{value:.2f}"
    fraction = metrics.get("share_of_bound") if share else None
    return text if fraction is None else f"{text} ({fraction:.0%})"


def suite_table(report: dict[str, Any]) -> Table:
    """One line per row: its goodput for each configuration, each preset's ratios to vLLM's
    defaults and the tuned vLLM (95% intervals), its p99 ITL ratio and whether it holds."""
    labels = report["suite"]["configs"]
    ours = list(report["summary"])
    table = Table(
        title=f"suite ({report['suite']['mode']}), goodput under the SLO"
        + (f" (share of the {BOUND} bound)" if BOUND in labels else "")
    )
    for column in ("row", "role", "goodput", *labels):
        table.add_column(
            column, justify="left" if column in ("row", "role", "goodput") else "right"
        )
    for label in ours:
        table.add_column(f"{label} / vllm", justify="right")
        table.add_column(f"{label} / tuned", justify="right")
        table.add_column("p99 ITL / vllm", justify="right")
        table.add_column("holds", justify="left")
    for name, row in report["rows"].items():
        if "error" in row:
            table.add_row(name, row["role"], "failed: " + row["error"][:60])
            continue
        metric = row["goodput_metric"]
        unit = "jobs/h" if metric == "slo_jobs_per_hour" else "req/s"
        cells = [name, row["role"], unit]
        cells += [
            _value(row["configs"].get(label), metric, share=label != BOUND) for label in labels
        ]
        for label in ours:
            ratios = row["ratios"][label]
            cells += [
                _ratio_cell(ratios["vllm"]["goodput"]),
                _ratio_cell(ratios["vllm-tuned"]["goodput"]),
                _ratio_cell(ratios["vllm"]["itl_p99"]),
                _holds_cell(row["verdict"][label]),
            ]
        table.add_row(*cells)
    return table


def _holds_cell(verdict: dict[str, Any]) -> str:
    if verdict["holds"]:
        return "yes"
    failed = [test for test in ("goodput", "interval", "itl") if not verdict[f"{test}_holds"]]
    return "no: " + ", ".join(failed)


FALLOFF_SLO = 0.9  # the share of requests meeting the SLO below which a load is past capacity


def falloff_lines(report: dict[str, Any]) -> list[str]:
    """Where each configuration falls off as agents grow: the first agent row whose SLO
    attainment drops under 0.9 (nothing when the report has fewer than two agent rows)."""
    agent_rows = [
        (name, row)
        for name, row in report["rows"].items()
        if "error" not in row and row["workload"] == "agents"
    ]
    if len(agent_rows) < 2:
        return []
    lines = []
    for label in report["suite"]["configs"]:
        shares = [
            (n, r["configs"][label]["slo_attainment"])
            for n, r in agent_rows
            if label in r["configs"]
        ]
        if not shares:
            continue
        past = next((n for n, share in shares if share is not None and share < FALLOFF_SLO), None)
        trail = ", ".join(
            f"{n} {share:.2f}" if share is not None else f"{n} n/a" for n, share in shares
        )
        where = f"falls off at {past}" if past else f"holds through {shares[-1][0]}"
        lines.append(f"{label}: {where} (requests meeting the SLO: {trail})")
    return lines


def summary_lines(report: dict[str, Any]) -> list[str]:
    """Per preset: the rows it holds on, chosen and reported apart, and the rows it loses."""
    lines = []
    for label, summary in report["summary"].items():
        parts = []
        for role, what in (("choose", "rows it is chosen on"), ("report", "rows only reported")):
            s = summary[role]
            loses = f" (loses {', '.join(s['loses'])})" if s["loses"] else ""
            tests = ", ".join(
                f"{test} {s[f'{test}_holds']}/{s['rows']}"
                for test in ("goodput", "interval", "itl")
            )
            parts.append(f"{s['holds']}/{s['rows']} {what} [{tests}]{loses}")
        failed = summary["failed_rows"]
        tail = f"; failed rows: {', '.join(failed)}" if failed else ""
        lines.append(f"{label} never loses on {'; '.join(parts)}{tail}")
    return lines
