"""`hybridserve agents --url URL`: the E1 agent workload against any OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hybridserve.cli.app import FINITE_FLOAT, app, err, fail, install_hint, out_console
from hybridserve.cli.choices import SERVED_MODEL_HELP
from hybridserve.cli.options import (
    AgentsOption,
    ApiKeyOption,
    JsonOption,
    OutOption,
    VocabOption,
    WarmupOption,
)
from hybridserve.core.errors import HybridServeError

if TYPE_CHECKING:
    from hybridserve.loadgen.run import Arrival, LoadConfig, LoadRun, LoadStats
    from hybridserve.sim.workload import AgentParams

UrlOption = Annotated[
    str, typer.Option(help="The server's base URL, e.g. http://127.0.0.1:8000 (no /v1).")
]
ServedModelOption = Annotated[
    str | None,
    typer.Option(help=SERVED_MODEL_HELP),
]
WORKLOAD_HELP = (
    "agents (E1), or a trace replayed open-loop in wall-clock time: mooncake:PATH, azure:PATH."
)
SHOWN = (
    "job_goodput_per_hour",
    "jobs_completed",
    "output_tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "slo_attainment",
    "prefix_hit_rate",
    "cached_tokens_per_turn",
    "requests_sent",
    "requests_completed",
    "requests_failed",
    "requests_unfinished_at_end",
)


RunDurationOpt = Annotated[
    float,
    typer.Option(parser=FINITE_FLOAT, help="The run's length in wall seconds, warm-up included."),
]
StreamSeedOpt = Annotated[int, typer.Option(help="Seed of the agents' streams.")]
ToolTimeScaleOpt = Annotated[
    float,
    typer.Option(
        parser=FINITE_FLOAT, help="Wall seconds per drawn tool second (a trace: per trace second)."
    ),
]
SystemPromptOpt = Annotated[int, typer.Option(help="The shared system/tool prompt's tokens.")]
MaxContextOpt = Annotated[int, typer.Option(help="A job ends when its context would pass this.")]
OutputTokensOpt = Annotated[
    float | None,
    typer.Option(parser=FINITE_FLOAT, help="Median answer length [default: 150, E1's]."),
]
ToolResultOpt = Annotated[
    float | None,
    typer.Option(parser=FINITE_FLOAT, help="Median tool result length [default: 300, E1's]."),
]
ConcurrencyOpt = Annotated[
    int | None, typer.Option(help="Requests in flight at once [default: no limit].")
]
AgentsWorkloadOpt = Annotated[str, typer.Option(help=WORKLOAD_HELP)]
AnswersOpt = Annotated[
    str,
    typer.Option(
        help="What a job appends after each answer: synthetic (drawn tokens: every server on a "
        "seed sees the same prompts) or server (the tokens the server generated, as a real "
        "agent sends them: its cache of its own answer counts; needs a server that returns "
        "token ids, e.g. vLLM 0.10.2+ or hybridserve)."
    ),
]


@app.command("agents")
def agents_cmd(
    url: UrlOption,
    model: ServedModelOption = None,
    api_key: ApiKeyOption = None,
    agents: AgentsOption = 20,
    duration: RunDurationOpt = 600.0,
    warmup: WarmupOption = 60.0,
    seed: StreamSeedOpt = 0,
    time_scale: ToolTimeScaleOpt = 1.0,
    system_prompt_tokens: SystemPromptOpt = 12_000,
    max_context: MaxContextOpt = 131_072,
    output_tokens: OutputTokensOpt = None,
    tool_result_tokens: ToolResultOpt = None,
    concurrency_limit: ConcurrencyOpt = None,
    vocab_size: VocabOption = 256,
    workload: AgentsWorkloadOpt = "agents",
    answers: AnswersOpt = "synthetic",
    out: OutOption = None,
    as_json: JsonOption = False,
) -> None:
    """Run the simulator's E1 agents (or a trace) against a running OpenAI-compatible server:
    token-id prompts on /v1/completions, streamed, and report what `bench` reports."""
    need_httpx()
    from hybridserve.loadgen.run import LoadConfig, run_load

    try:
        config = LoadConfig(
            url=url,
            model=model,
            api_key=api_key,
            seed=seed,
            duration_s=duration,
            warmup_s=warmup,
            time_scale=time_scale,
            concurrency_limit=concurrency_limit,
            vocab_size=vocab_size,
            answers=answers,
        )
        params, arrivals = _workload(
            workload,
            config,
            agents=agents,
            system_prompt_tokens=system_prompt_tokens,
            max_context=max_context,
            output_tokens=output_tokens,
            tool_result_tokens=tool_result_tokens,
        )
        with _progress_bar(config, quiet=as_json) as progress:
            run = asyncio.run(run_load(config, agents=params, arrivals=arrivals, progress=progress))
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        raise fail("interrupted: no report was written") from None
    _report(run, workload=workload, out=out, as_json=as_json)


def need_httpx() -> None:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise fail(
            f"this command needs httpx (the 'server' extra): {install_hint('server')}"
        ) from None


def _workload(
    workload: str,
    config: LoadConfig,
    *,
    agents: int,
    system_prompt_tokens: int,
    max_context: int,
    output_tokens: float | None,
    tool_result_tokens: float | None,
) -> tuple[AgentParams | None, list[Arrival] | None]:
    from hybridserve.core.errors import ConfigError
    from hybridserve.sim.arrivals import azure_arrivals, mooncake_arrivals
    from hybridserve.sim.workload import AgentParams

    if workload == "agents":
        params = AgentParams(
            num_agents=agents,
            system_prompt_tokens=system_prompt_tokens,
            context_limit=max_context,
        ).with_medians(output_tokens=output_tokens, tool_result_tokens=tool_result_tokens)
        return params, None
    kind, _, path = workload.partition(":")
    readers = {"mooncake": mooncake_arrivals, "azure": azure_arrivals}
    if kind not in readers or not path:
        raise ConfigError("--workload", workload, "use agents, mooncake:PATH or azure:PATH")
    if config.answers != "synthetic":
        raise ConfigError(
            "--answers", config.answers, "a trace's prompts carry no answers: drop --answers"
        )
    return None, list(readers[kind](Path(path), time_scale=config.time_scale))


class _progress_bar:
    """A progress bar in wall seconds on stderr (none with --json), as a context manager that
    gives the run's progress callback."""

    def __init__(self, config: LoadConfig, *, quiet: bool) -> None:
        self.config, self.quiet = config, quiet
        self.bar: Progress | None = None

    def __enter__(self) -> Any:
        if self.quiet:
            return None
        columns = (
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            TextColumn("{task.completed:.0f} / {task.total:.0f} s"),
            TimeElapsedColumn(),
        )
        self.bar = Progress(*columns, console=err, transient=True)
        self.bar.__enter__()
        task = self.bar.add_task("agents", total=self.config.duration_s)
        bar = self.bar

        def progress(now: float, stats: LoadStats) -> None:
            failed = sum(stats.failures.values())
            label = f"{stats.requests_completed} done, {failed} failed, {stats.jobs_finished} jobs"
            bar.update(task, completed=now, description=label)

        return progress

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


def _report(run: LoadRun, *, workload: str, out: Path | None, as_json: bool) -> None:
    from hybridserve.loadgen.run import report_json

    metrics = report_json(run)
    if out is not None:
        _write_report(out, run, metrics, workload=workload)
    if as_json:
        sys.stdout.write(json.dumps(metrics) + "\n")
        return
    console = out_console()
    console.print(f"agents: {run.model} at {run.config.url}, seed {run.config.seed}, {workload}")
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in SHOWN:
        value = run.summary.get(key, math.nan)
        table.add_row(key, "-" if math.isnan(value) else f"{value:,.3f}")
    console.print(table)
    by_status = metrics["requests_failed_by_status"]
    if by_status:
        console.print(
            "failed requests by status: " + ", ".join(f"{k}: {v}" for k, v in by_status.items())
        )
    if not run.stats.cached_reported and run.stats.requests_completed:
        console.print(
            "note: the server reported no cached prompt tokens (vLLM needs "
            "--enable-prompt-tokens-details); prefix_hit_rate is 0 for that reason"
        )


def _write_report(out: Path, run: LoadRun, metrics: dict[str, Any], *, workload: str) -> None:
    from hybridserve.loadgen.run import request_rows
    from hybridserve.metrics.plots import plots_available, write_plots

    out.mkdir(parents=True, exist_ok=True)
    config = run.config
    setup = {
        "url": config.url,
        "model": run.model,
        "workload": workload,
        "seed": config.seed,
        "duration_s": config.duration_s,
        "warmup_s": config.warmup_s,
        "time_scale": config.time_scale,
        "vocab_size": config.vocab_size,
        "answers": config.answers,
    }
    label = "server"
    (out / "report.json").write_text(json.dumps({label: metrics, "setup": setup}, indent=2) + "\n")
    rows = request_rows(run)
    (out / "requests.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if plots_available():
        write_plots(out, {label: run})
    else:
        err.print(f"plots skipped: matplotlib is not installed ({install_hint('sim')})")
