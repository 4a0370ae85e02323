"""The command line declares each option once: an option alias (`X = Annotated[..., typer.Option]`)
lives in one cli module, shared ones in `hybridserve/cli/options.py`; and the scheduler's flags
are generated from `SchedulerConfig`, one per field, on every command that takes them."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import fields
from pathlib import Path

import pytest
import typer

from hybridserve.cli import app
from hybridserve.cli.options import SCHEDULER_FLAG_HELP, scheduler_flags
from hybridserve.core.config import SchedulerConfig

CLI = Path(__file__).parents[2] / "hybridserve" / "cli"
FIELDS = [f.name for f in fields(SchedulerConfig)]


def _aliases(source: str) -> dict[str, ast.Assign]:
    """The module-level `Name = Annotated[...]` assignments of a module, by name."""
    found = {}
    for node in ast.parse(source).body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Subscript)
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "Annotated"
        ):
            found[node.targets[0].id] = node
    return found


def _help(node: ast.Assign) -> str | None:
    """The literal help text of an alias's typer.Option, when it is a plain string."""
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            for keyword in call.keywords:
                value = keyword.value
                if keyword.arg == "help" and isinstance(value, ast.Constant):
                    return str(value.value)
    return None


def _modules() -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(CLI.glob("*.py"))}


def _stem(name: str) -> str:
    """An alias's name without its Opt/Option suffix: SeedOpt and SeedOption are one name."""
    return re.sub(r"(Opt|Option)$", "", name)


def test_no_option_alias_is_declared_in_two_cli_modules() -> None:
    where = defaultdict(set)
    for module, source in _modules().items():
        for name in _aliases(source):
            where[_stem(name)].add(module)
    twice = {name: sorted(modules) for name, modules in where.items() if len(modules) > 1}
    assert not twice, f"declare these once in hybridserve/cli/options.py: {twice}"


def test_no_option_help_text_is_written_in_two_cli_modules() -> None:
    where = defaultdict(set)
    for module, source in _modules().items():
        for node in _aliases(source).values():
            text = _help(node)
            if text is not None:
                where[text].add(module)
    twice = {text: sorted(modules) for text, modules in where.items() if len(modules) > 1}
    assert not twice, f"one option under two names; share it from options.py: {twice}"


def test_commands_take_shared_options_from_the_options_module_only() -> None:
    declared = {module: set(_aliases(source)) for module, source in _modules().items()}
    for module, source in _modules().items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "hybridserve.cli."
            ):
                owner = node.module.rsplit(".", 1)[1] + ".py"  # type: ignore[union-attr]
                if owner == "options.py":
                    continue
                borrowed = {alias.name for alias in node.names} & declared.get(owner, set())
                assert not borrowed, f"{module} takes {sorted(borrowed)} from {owner}"


def test_every_scheduler_field_has_one_line_of_flag_help() -> None:
    assert list(SCHEDULER_FLAG_HELP) == FIELDS


def _options(command: str) -> list[str]:
    click_app = typer.main.get_command(app)
    params = click_app.commands[command].params  # type: ignore[attr-defined]
    return [opt for param in params for opt in param.opts]


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_scheduler_field_is_exactly_one_flag(command: str) -> None:
    options = _options(command)
    for name in FIELDS:
        flag = "--" + name.replace("_", "-")
        assert options.count(flag) == 1, (command, flag)


def test_a_command_cannot_declare_a_scheduler_flag_itself() -> None:
    def command(max_num_seqs: int = 1, **scheduler: object) -> None:
        del max_num_seqs, scheduler

    with pytest.raises(TypeError, match="max_num_seqs"):
        scheduler_flags(command)


def test_scheduler_flags_reach_the_command_by_field_name() -> None:
    seen: dict[str, object] = {}

    def command(name: str = "x", **scheduler: object) -> None:
        seen.update(scheduler, name=name)

    one = typer.Typer()
    one.command()(scheduler_flags(command))
    from typer.testing import CliRunner

    result = CliRunner().invoke(one, ["--max-num-seqs", "7", "--policy", "priority"])
    assert result.exit_code == 0, result.output
    assert seen["max_num_seqs"] == 7 and seen["policy"] == "priority"
    assert seen["max_num_batched_tokens"] is None and seen["name"] == "x"
    assert set(seen) == {"name", *FIELDS}
