"""What the long commands share on the terminal: a progress bar over runs, and Ctrl-C."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from hybridserve.cli.app import err


def interrupted(what: str) -> typer.Exit:
    """Ctrl-C: say what happened to the work, and exit 130 (128 + SIGINT), as shells expect."""
    err.print(f"interrupted: {what}", soft_wrap=True)
    return typer.Exit(code=130)


@contextmanager
def runs_progress(total: int, *, quiet: bool) -> Iterator[Callable[[str], None] | None]:
    """A progress bar over `total` runs on stderr, with the time left, fed one line per
    finished run (`3/21 baseline seed=0`); nothing when `quiet`."""
    if quiet:
        yield None
        return
    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err) as bar:
        task = bar.add_task("runs", total=total)

        def log(line: str) -> None:
            bar.update(task, advance=1, description=line)

        yield log
