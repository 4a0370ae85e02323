"""Bad command-line values end in an error naming the flag, the value and the fix (exit 2),
never a traceback or a silent acceptance; Ctrl-C exits 130 and keeps what finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hybridserve.cli import app

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize("port", ["99999", "-1", "0"])
def test_serve_refuses_a_port_outside_the_tcp_range(port: str) -> None:
    code, text = _run(["serve", "--executor", "sim", "--port", port])
    assert code == 2 and f"--port={port} is invalid" in text and "1-65535" in text


def test_serve_refuses_max_waiting_zero_instead_of_answering_every_request_503() -> None:
    code, text = _run(["serve", "--executor", "sim", "--max-waiting", "0"])
    assert code == 2 and "--max-waiting=0 is invalid" in text and "1 or more" in text


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--tool-call-parser", "nope"), ("--reasoning-parser", "nope"), ("--metrics-names", "x")],
)
def test_serve_refuses_an_unknown_parser_or_metric_namespace_naming_the_flag(
    flag: str, value: str
) -> None:
    code, text = _run(["serve", "--executor", "sim", flag, value])
    assert code == 2 and flag in text and repr(value) in text, text


def test_serve_takes_vllms_enable_auto_tool_choice_flag() -> None:
    # A vLLM command line's flag is accepted: the run goes on to the next check (the port).
    code, text = _run(["serve", "--executor", "sim", "--enable-auto-tool-choice", "--port", "0"])
    assert code == 2 and "--port=0 is invalid" in text


@pytest.mark.parametrize("tp", ["3", "1024"])
def test_tensor_parallel_width_must_split_the_heads(tp: str) -> None:
    for command in (["simulate", "--duration", "10", "--warmup", "0"], ["serve"]):
        code, text = _run([*command, "--tp", tp])  # qwen3-next-80b-a3b: 16 attention heads
        assert code == 2, (command, text)
        assert f"tp (--tp)={tp} is invalid" in text and "16 attention heads" in text
        assert "[1, 2, 4, 8, 16]" in text


def test_an_fp4_kv_cache_is_refused() -> None:
    code, text = _run(["simulate", "--kv-dtype", "fp4", "--duration", "10", "--warmup", "0"])
    assert code == 2 and "kv_dtype (--kv-dtype)='fp4' is invalid" in text and "fp8" in text


def test_dcp_demo_refuses_an_interleave_that_does_not_divide_the_block() -> None:
    code, text = _run(["dcp-demo", "--interleave", "3"])
    assert code == 2 and "--interleave=3 is invalid: use 1, 2 or 4" in text


def test_ctrl_c_during_bench_writes_the_finished_runs_and_exits_130(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from hybridserve.sim import experiment

    real = experiment._run_one
    calls = []

    def second_is_interrupted(config: Any, keep: bool) -> Any:
        calls.append(config.preset)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(config, keep)

    monkeypatch.setattr(experiment, "_run_one", second_is_interrupted)
    folder = tmp_path / "b"
    args = ["bench", "--agents", "1", "--duration", "30", "--warmup", "0", "--name", str(folder)]
    args += ["--seeds", "1", "--workers", "1", "--no-bounds"]
    code, text = _run(args)
    assert code == 130
    assert "interrupted: finished runs (baseline) were written to" in text
    assert str(folder / "report.json") in text
    report = json.loads((folder / "report.json").read_text())
    assert report["interrupted"] is True and "baseline" in report and "hybridserve" not in report


def test_ctrl_c_during_sweep_writes_the_finished_trials_and_says_where(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from hybridserve.sim import sweep

    real, calls = sweep._run_trial, []

    def second_is_interrupted(config: Any) -> Any:
        calls.append(config)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(config)

    monkeypatch.setattr(sweep, "_run_trial", second_is_interrupted)
    monkeypatch.chdir(tmp_path)
    code, text = _run(
        ["sweep", "--trials", "2", "--agents", "1", "--duration", "30", "--warmup", "0"]
        + ["--workers", "1"]  # in this process: the patched trial runs here
    )
    assert code == 130 and "1 of 3 trials had finished; written to" in text
    [written] = (tmp_path / "runs").glob("sweep-interrupted-*.json")
    assert str(written.relative_to(tmp_path)) in text
    assert len(json.loads(written.read_text())["trials"]) == 1


def _default_sigint() -> None:
    # A suite started in the background of a non-interactive shell inherits SIGINT ignored,
    # and so would the command (Python keeps an ignored SIGINT ignored): give it a terminal's.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(args: list[str], *, after_s: float, tmp_path: Path) -> tuple[int, str]:
    """Start the command in its own process group, Ctrl-C the whole group after `after_s`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridserve.cli", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )
    time.sleep(after_s)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, stderr


def test_ctrl_c_of_a_running_simulate_exits_130_with_a_message(tmp_path: Path) -> None:
    code, stderr = _interrupt(["simulate", "--duration", "3600"], after_s=6, tmp_path=tmp_path)
    assert code == 130, stderr
    assert "interrupted: the run did not finish" in stderr and "Traceback" not in stderr


def test_ctrl_c_of_a_sweep_with_workers_stops_them_without_tracebacks(tmp_path: Path) -> None:
    args = ["sweep", "--trials", "3", "--workers", "2", "--duration", "900", "--warmup", "0"]
    code, stderr = _interrupt(args, after_s=8, tmp_path=tmp_path)
    assert code == 130, stderr
    assert "interrupted:" in stderr and "Traceback" not in stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["simulate", "--host-offload", "lru"], "--host-offload"),
        (["simulate", "--host-memory-gib", "-1"], "host_memory_gib"),
        (["simulate", "--host-memory-gib", "0.001"], "holds no block"),
        (["simulate", "--host-offload", "vllm", "--dcp", "2", "--host-memory-gib", "8"], "DCP"),
        (["bench", "--baseline", "vllm-offload", "--seeds", "1"], "--host-memory-gib"),
    ],
)
def test_a_bad_host_tier_flag_is_refused_naming_it(args: list[str], expected: str) -> None:
    code, text = _run([*args, "--duration", "20", "--warmup", "5"])
    assert code == 2 and expected in text, text
