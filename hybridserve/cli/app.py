"""The `hybridserve` Typer application and the helpers its commands share."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    help="hybridserve: an LLM serving engine core for hybrid models under prefill pressure.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)

DEFAULT_TRACE_NAME = "conversation_trace.jsonl"


def default_trace_path() -> Path | None:
    """The Mooncake conversation trace in ../shared/data/traces, if it is there."""
    candidates = [
        Path(__file__).resolve().parents[3] / "shared" / "data" / "traces",
        Path.cwd().parent / "shared" / "data" / "traces",
    ]
    for folder in candidates:
        if (folder / DEFAULT_TRACE_NAME).exists():
            return folder / DEFAULT_TRACE_NAME
    return None


def _version(value: bool) -> None:
    if value:
        from hybridserve import __version__

        typer.echo(f"hybridserve {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """hybridserve: an LLM serving engine core for hybrid models under prefill pressure."""


def fail(message: str) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", soft_wrap=True, highlight=False)
    return typer.Exit(code=2)
