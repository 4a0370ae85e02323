"""Text that reaches the user keeps its square brackets (no rich markup is read from it), and
every command's --help lists the valid models, GPUs and speculative methods, the same set."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from hybridserve.cli import app
from hybridserve.core.config import SpeculativeMethod
from hybridserve.layouts import LAYOUTS
from hybridserve.sim.gpus import GPUS
from hybridserve.sim.model_profiles import MODELS

COMMAND: Any = typer.main.get_command(app)
COMMANDS = sorted(COMMAND.commands)


def _flat(text: str) -> str:
    return " ".join(text.split())


def _help(name: str) -> str:
    result = CliRunner().invoke(app, [name, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    return _flat(result.output)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_help_is_shown_as_written_brackets_included(name: str) -> None:
    shown = _help(name)
    for param in COMMAND.commands[name].params:
        text = getattr(param, "help", None)
        if text:  # compared without whitespace: the formatter may wrap after a hyphen
            assert "".join(text.split()) in "".join(shown.split()), (param.name, text)
    assert "[" not in "".join(re.findall(r"\[/?(?:bold|red|green)\]", shown))


def test_help_lists_the_catalogs_the_same_in_every_command() -> None:
    simulate = _help("simulate")
    for name in (*MODELS, *GPUS, *(m.value for m in SpeculativeMethod)):
        assert name in simulate, name
    assert "[scheduler] fields and [cache] retention" in simulate
    assert "[default: H200, or the calibration's]" in simulate
    for command in ("bench", "sweep", "serve"):
        shown = _help(command)
        for name in (*MODELS, *GPUS):
            assert name in shown, (command, name)
    calibrate = _help("calibrate")
    assert all(gpu in calibrate for gpu in GPUS)
    for command in ("serve", "cache-replay", "bench", "sweep"):
        shown = _help(command)
        for method in SpeculativeMethod:
            assert method.value in shown, (command, method)
    replay = _help("cache-replay")
    assert all(layout in replay for layout in LAYOUTS)


def test_an_error_message_keeps_its_square_brackets(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[engine]\nsize = 1\n")
    result = CliRunner().invoke(app, ["serve", "--executor", "sim", "--config", str(config)])
    assert result.exit_code == 2
    assert "the tables [scheduler] and [cache]" in _flat(result.output)


def test_a_bracketed_value_in_a_table_title_is_printed_as_given(tmp_path: Path) -> None:
    trace = tmp_path / "trace[1].jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]}\n'
    )
    result = CliRunner().invoke(
        app, ["cache-replay", "--trace", str(trace), "--model", "llama-3.1-8b"]
    )
    assert result.exit_code == 0, result.output
    # A long temporary path may wrap anywhere; markup would have eaten the brackets.
    assert "trace[1].jsonl" in re.sub(r"\s+", "", result.output)


def test_bench_shows_a_progress_bar_over_its_runs_with_the_time_left(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "hybridserve.cli", "bench", "--agents", "2"]
    command += ["--duration", "40", "--warmup", "5", "--seeds", "2", "--no-bounds"]
    command += ["--workers", "1"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # Four runs (two configurations on two seeds): the bar ends at 4/4 with the time left.
    assert "4/4 hybridserve seed=1" in done.stderr and "left" in done.stderr
