"""The `hybridserve` Typer application and the helpers its commands share."""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.text import Text

if TYPE_CHECKING:
    from hybridserve.engine.settings import SettingsFile

app = typer.Typer(
    help="hybridserve: an LLM serving engine core for hybrid models under prefill pressure.\n\n"
    "--model names what a command runs: a model profile (simulated) in simulate, bench, "
    "sweep, fleet-sweep and suite (serve takes it as --model-profile); a checkpoint in "
    "generate, serve and calibrate; the served model's name at --url in agents and "
    "calibrate --url; a named cache layout in cache-replay; a tiny random-weight model in "
    "dcp-demo.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help text is plain: option lists such as `[scheduler]` or `[default: ...]` are shown as
    # written, never read as rich markup.
    rich_markup_mode=None,
)
# Every console of the command line prints plain text (markup off): user values, paths and
# messages keep their square brackets. Colour is given with Text styles instead.
err = Console(stderr=True, markup=False)


def out_console() -> Console:
    """A console on stdout that prints plain text (no rich markup)."""
    return Console(markup=False)


DEFAULT_TRACE_NAME = "conversation_trace.jsonl"


def default_trace_path() -> Path | None:
    """The Mooncake conversation trace in the data folder (`data/traces`, or under
    `$HYBRIDSERVE_DATA`), if it is there."""
    from hybridserve.core.paths import data_path

    path = data_path("traces", DEFAULT_TRACE_NAME)
    return path if path.exists() else None


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
    """Print `error: MESSAGE` on stderr (the message is plain text: brackets survive) and
    return the exit to raise (code 2)."""
    err.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True, highlight=False)
    return typer.Exit(code=2)


# The modules of the `models` extra (the torch executor's runtime), checked before a torch command.
MODELS_EXTRA = ("torch", "safetensors", "gguf", "tokenizers", "jinja2")


def install_hint(extra: str) -> str:
    """The exact command that installs an optional extra."""
    return f"pip install 'hybridserve[{extra}]'"


def need_extra(extra: str, *modules: str, what: str) -> None:
    """Import `modules` or stop with an error naming the missing one and the extra to install."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing = exc.name or module
            raise fail(
                f"{what} needs the {extra!r} extra ({missing} is not installed): "
                f"{install_hint(extra)}"
            ) from None


def finite_float(value: Any) -> float:
    """The parser of every float flag: nan and inf are refused (every later check, such as
    `value < 0`, lets nan through)."""
    if isinstance(value, float):  # a default, already a float
        number = value
    else:
        try:
            number = float(value)
        except ValueError:
            raise typer.BadParameter(f"{value!r} is not a number; give one such as 0.5") from None
    if not math.isfinite(number):
        raise typer.BadParameter(f"{value!r} is not a finite number; give one such as 0.5")
    return number


# Help shows the flag's metavar as FLOAT, as for a plain float flag.
finite_float.__name__ = "float"
# The parser of every float flag of the command line (a test checks that none is missed).
FINITE_FLOAT = finite_float


def read_settings_file(path: Path | None) -> SettingsFile | None:
    """The `--config` file of any command, its deprecated spellings reported on stderr as
    warnings."""
    from hybridserve.engine.settings import load_settings_file

    if path is None:
        return None
    file = load_settings_file(path)
    for message in file.deprecations:
        err.print(f"warning: {path}: {message}", soft_wrap=True, highlight=False)
    return file
