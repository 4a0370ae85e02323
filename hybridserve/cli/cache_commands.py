"""`hybridserve cache-replay` and `hybridserve replay-vllm`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from hybridserve.cache_replay.runner import CacheReplay, ReplayResult
from hybridserve.cache_replay.trace import TraceRecord, load_mooncake, synthetic_agent_trace
from hybridserve.cli.app import app, default_trace_path, err, fail, out_console
from hybridserve.cli.choices import CACHE_LAYOUTS, SPECULATION_HELP, listed
from hybridserve.cli.options import (
    LimitOption,
)
from hybridserve.core.config import SpeculativeConfig
from hybridserve.core.errors import HybridServeError
from hybridserve.kvcache import CacheLayout, MambaSpec, Retention
from hybridserve.layouts import get_layout, parse_groups

TraceOption = Annotated[
    Path | None,
    typer.Option(
        help="Mooncake JSONL trace; default: the conversation trace in data/traces "
        "(or $HYBRIDSERVE_DATA/traces), else a built-in synthetic agent trace."
    ),
]
LayoutOption = Annotated[
    str | None, typer.Option(help=f"Named cache layout: {listed(CACHE_LAYOUTS)}.")
]
GroupsOption = Annotated[
    str | None,
    typer.Option(help="Explicit groups, e.g. full:16,mamba:16 or full:16,swa:16:w=4096."),
]
AlignmentOption = Annotated[int, typer.Option(help="Alignment unit A in tokens (0 = the page P).")]
HashBlockOption = Annotated[int, typer.Option(help="Hash unit H (0 = smallest unit).")]
CacheSpeculationOption = Annotated[str, typer.Option("--spec", help=SPECULATION_HELP)]
RetentionsOption = Annotated[
    str | None,
    typer.Option(
        help="dense|boundary|boundary+predecessor|interval:N; several comma-separated "
        "run side by side (default: boundary,boundary+predecessor)."
    ),
]
CacheDcpOption = Annotated[int, typer.Option(help="Decode-context-parallel width.")]
PoolBlocksOption = Annotated[str, typer.Option(help="KV pool size in blocks, or inf.")]
ResidentOption = Annotated[int, typer.Option(help="Requests kept resident before finishing.")]
ReplayJsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


@app.command("cache-replay")
def cache_replay(
    trace: TraceOption = None,
    model: LayoutOption = None,
    groups: GroupsOption = None,
    alignment: AlignmentOption = 0,
    hash_block_size: HashBlockOption = 0,
    speculation: CacheSpeculationOption = "eagle",
    retention: RetentionsOption = None,
    dcp: CacheDcpOption = 1,
    num_blocks: PoolBlocksOption = "inf",
    concurrency: ResidentOption = 16,
    limit: LimitOption = None,
    as_json: ReplayJsonOption = False,
) -> None:
    """Replay a block-hash trace through the cache alone: per-group, reconciled, ideal hits."""
    try:
        records, trace_name = _load_records(trace, limit)
        layouts, name = _build_layouts(
            model=model,
            groups=groups,
            alignment=alignment,
            hash_block_size=hash_block_size,
            speculation=speculation,
            retention=retention,
            dcp=dcp,
            num_blocks=num_blocks,
        )
        if concurrency < 1:
            raise fail(f"--concurrency={concurrency}; use 1 or more")
    except HybridServeError as exc:
        raise fail(str(exc)) from None
    unbounded = num_blocks.strip().lower() == "inf"
    results = [
        _replay_one(
            layout,
            records,
            name=name,
            concurrency=concurrency,
            unbounded=unbounded,
            show_progress=not as_json,
        )
        for layout in layouts
    ]
    if as_json:
        payload = (
            results[0].to_json() if len(results) == 1 else {"runs": [r.to_json() for r in results]}
        )
        payload = {"trace": trace_name, **payload}
        sys.stdout.write(json.dumps(payload) + "\n")
        return
    _print_table(results, trace_name=trace_name, num_blocks=num_blocks, concurrency=concurrency)


def _load_records(trace: Path | None, limit: int | None) -> tuple[list[TraceRecord], str]:
    if limit is not None and limit < 1:
        raise fail(f"--limit={limit}; use 1 or more")
    path = trace if trace is not None else default_trace_path()
    if path is None:
        records = synthetic_agent_trace()
        return records[:limit] if limit else records, "built-in synthetic agent trace"
    return load_mooncake(path, limit=limit), str(path)


def _build_layouts(
    *,
    model: str | None,
    groups: str | None,
    alignment: int,
    hash_block_size: int,
    speculation: str,
    retention: str | None,
    dcp: int,
    num_blocks: str,
) -> tuple[list[CacheLayout], str]:
    if model and groups:
        raise fail("give --model or --groups, not both")
    if groups:
        group_specs, name = parse_groups(groups), groups
    else:
        named = get_layout(model or "qwen3-next-80b-a3b")
        group_specs, name = named.groups, named.name
    blocks = num_blocks.strip().lower()
    if blocks == "inf":
        pool = 1024  # grows on demand
    elif blocks.isdigit() and int(blocks) >= 2:
        pool = int(blocks)
    else:
        raise fail(f"--num-blocks={num_blocks!r}; use an integer >= 2 or inf")
    # Retention chooses which Mamba states are kept: without a Mamba group every retention
    # replays the same, so the default compares two only where there is one.
    has_state = any(isinstance(g, MambaSpec) for g in group_specs)
    default = "boundary,boundary+predecessor" if has_state else "boundary"
    retentions = [Retention.parse(p) for p in (retention or default).split(",")]
    speculative = SpeculativeConfig.from_name(speculation)
    layouts = [
        CacheLayout(
            groups=group_specs,
            num_blocks=pool,
            hash_block_size=hash_block_size,
            alignment_tokens=alignment,
            dcp=dcp,
            speculative=speculative,
            retention=kept,
        )
        for kept in retentions
    ]
    return layouts, name


def _replay_one(
    layout: CacheLayout,
    records: list[TraceRecord],
    *,
    name: str,
    concurrency: int,
    unbounded: bool,
    show_progress: bool,
) -> ReplayResult:
    replay = CacheReplay(layout, concurrency=concurrency, unbounded=unbounded)
    if not show_progress:
        return replay.run(records, name=name)
    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task(f"replay ({layout.retention.name})", total=len(records))
        return replay.run(records, name=name, progress=lambda n: progress.update(task, completed=n))


def _print_table(
    results: list[ReplayResult], *, trace_name: str, num_blocks: str, concurrency: int
) -> None:
    first = results[0]
    table = Table(
        title=f"cache-replay: {first.layout_name}, spec={first.speculation}, "
        f"num_blocks={num_blocks}, concurrency={concurrency}"
    )
    table.add_column("metric")
    for result in results:
        table.add_column(f"retention={result.retention}", justify="right")
    rows: list[tuple[str, list[str]]] = [
        ("requests (rejected)", [f"{r.requests} ({r.rejected})" for r in results]),
        ("queried tokens", [f"{r.queried_tokens:,}" for r in results]),
        ("cacheable tokens", [f"{r.cacheable_tokens:,}" for r in results]),
        ("reconciled hit tokens", [f"{r.hit_tokens:,}" for r in results]),
        ("hit rate", [f"{r.hit_rate:.4f}" for r in results]),
    ]
    for g, group in enumerate(first.group_names):
        rows.append((f"group {group} offered", [f"{r.group_hit_tokens[g]:,}" for r in results]))
        rows.append((f"group {group} limiting", [f"{r.group_limiting[g]:,}" for r in results]))
    rows += [
        (
            "ideal full-attention hit rate",
            [f"{r.ideal_full_attention_hit_rate:.4f}" for r in results],
        ),
        ("registered blocks", [f"{r.registered_blocks:,}" for r in results]),
        ("evicted blocks", [f"{r.evicted_blocks:,}" for r in results]),
    ]
    for label, values in rows:
        table.add_row(label, *values)
    console = out_console()
    console.print(f"trace: {trace_name}")
    console.print(table)


@app.command("replay-vllm")
def replay_vllm(
    files: Annotated[list[Path], typer.Argument(help="vllm-sched-trace/1 JSONL recordings.")],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object per file.")
    ] = False,
    check_invariants: Annotated[
        bool, typer.Option(help="Check the cache's invariants after every step (slower).")
    ] = False,
) -> None:
    """Replay recorded vLLM scheduler decisions through the hybridserve baseline, step by step.

    Exits 0 only if every step of every file is identical.
    """
    from hybridserve.recordings.recording import load_recording
    from hybridserve.recordings.replay import replay_recording

    all_identical = True
    for path in files:
        try:
            recording = load_recording(path)
            report = replay_recording(recording, check_invariants=check_invariants)
        except HybridServeError as exc:
            raise fail(str(exc)) from None
        all_identical &= report.first_divergence is None
        if as_json:
            sys.stdout.write(json.dumps(report.to_json()) + "\n")
            continue
        status = ("identical", "green") if report.first_divergence is None else ("diverged", "red")
        out_console().print(
            Text.assemble(
                f"{path.name}: {report.identical_steps}/{report.steps} steps match vLLM: ", status
            ),
            highlight=False,
        )
        if report.first_divergence is not None:
            d = report.first_divergence
            want, got = d["expected"], d["actual"]
            where = ""
            if "index" in d:
                i = d["index"]
                where = f" (first difference at item {i})"
                want, got = want[max(i - 2, 0) : i + 3], got[max(i - 2, 0) : i + 3]
            out_console().print(
                f"  first divergence at step {d['step']}, field {d['field']}{where}:\n"
                f"    vLLM:        {want}\n    hybridserve: {got}",
                highlight=False,
                soft_wrap=True,
            )
    if not all_identical:
        raise typer.Exit(code=1)
