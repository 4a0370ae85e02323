"""`hybridserve dcp-demo`: decode context parallel on local CPU ranks. Imports torch lazily."""

from __future__ import annotations

import json
import warnings
from typing import Annotated

import typer

from hybridserve.cli.app import app, fail, need_extra

DEMO_INTERLEAVES = (1, 2, 4)


@app.command("dcp-demo")
def dcp_demo(
    dcp: Annotated[int, typer.Option("--dcp", min=1, help="Ranks (local gloo processes).")] = 2,
    model: Annotated[
        str, typer.Option(help="Tiny random-weight model: gqa, mla or sparse-mla.")
    ] = "sparse-mla",
    interleave: Annotated[int, typer.Option(help="Tokens per rank in a row: 1, 2 or 4.")] = 1,
) -> None:
    """Greedy decode with the KV sharded over N ranks; checks the tokens equal the unsharded run."""
    # CPU torch wheels without numpy warn about it on import; it does not matter here.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    if interleave not in DEMO_INTERLEAVES:
        raise fail(
            f"--interleave={interleave} is invalid: use 1, 2 or 4 (tokens per rank in a row "
            "must divide the demo's block size)"
        )
    need_extra("torch", "torch", what="hybridserve dcp-demo")
    from hybridserve.parallel.demo import run_demo

    try:
        report = run_demo(dcp=dcp, model=model, interleave=interleave)
    except (ValueError, RuntimeError) as exc:
        raise fail(str(exc)) from exc
    typer.echo(json.dumps(report))
    if not report["identical"]:
        raise typer.Exit(code=1)
