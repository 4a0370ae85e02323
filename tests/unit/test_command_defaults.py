"""What a newcomer meets first: `serve --model` serves that model, one default per knob across
commands, the bench names the README's E1 design, `make models` installs the models extra, a
busy port is refused before a model loads, and the first Ctrl-C says what the server waits for."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from hybridserve.cli import app
from hybridserve.cli.serve_commands import build_app
from hybridserve.cli.sim_backend import SimServingBackend
from hybridserve.server.app import ServerSettings
from hybridserve.server.runner import HybridServer, server_config

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, " ".join(result.output.split())


def _default(command: str, name: str) -> object:
    params = typer.main.get_command(app).commands[command].params  # type: ignore[attr-defined]
    return next(p.default for p in params if p.name == name)


# ----- serve --model ---------------------------------------------------------------------------


def test_serve_with_a_checkpoint_and_no_executor_runs_it_on_torch_and_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hybridserve.cli.serve_commands import chosen_executor

    assert chosen_executor(None, "smollm2") == ("torch", "smollm2")
    assert "serving it on the torch executor (--executor torch)" in capsys.readouterr().err
    assert chosen_executor(None, None) == ("sim", "smollm2")  # no --model: the simulator
    assert chosen_executor("torch", None) == ("torch", "smollm2")
    # Through the command: --dcp is a torch flag, so the run gets as far as the checkpoint.
    code, text = _run(["serve", "--model", "/no/such/checkpoint", "--dcp", "2"])
    assert code == 2 and "--model '/no/such/checkpoint': use smollm2 or gemma3-270m" in text


def test_serve_refuses_a_checkpoint_with_the_simulated_executor() -> None:
    code, text = _run(["serve", "--executor", "sim", "--model", "smollm2"])
    assert code == 2 and "--model 'smollm2' with --executor sim" in text
    assert "--model-profile NAME" in text and "--executor torch" in text


# ----- one default per knob --------------------------------------------------------------------


def test_sweep_takes_the_bench_defaults_for_workers_and_the_itl_slo() -> None:
    for name, value in (("workers", 2), ("itl_slo_ms", 100.0)):
        assert _default("sweep", name) == _default("bench", name) == value, name


def test_generate_and_serve_default_to_the_same_device() -> None:
    from hybridserve.cli.generate_commands import GenerateSettings

    assert _default("generate", "device") == _default("serve", "device") == "auto"
    assert GenerateSettings().device == "auto"


def test_bench_names_the_600_second_design_of_the_readme(tmp_path: Path) -> None:
    args = ["bench", "--agents", "1", "--duration", "30", "--warmup", "0", "--seeds", "1"]
    code, text = _run([*args, "--workers", "1", "--no-bounds", "--name", str(tmp_path / "b")])
    assert code == 0, text
    assert "The full design (10 paired seeds, 600 s runs with a 120 s warm-up)" in text
    assert "benchmarks/e1_matrix.py --seeds 10 --duration 600 --warmup 120" in text
    assert "1,800" not in text
    # The design the text names is the one the E1 script's docstring gives for the README.
    assert (
        "--duration 600 --warmup 120 --workers 2" in (ROOT / "benchmarks/e1_matrix.py").read_text()
    )


# ----- make models -----------------------------------------------------------------------------


def _make_dry_run(target: str, venv: Path) -> str:
    done = subprocess.run(
        ["make", "-n", "-C", str(ROOT), target, f"VENV={venv}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_models_installs_only_the_models_extra(tmp_path: Path) -> None:
    models = _make_dry_run("models", tmp_path / "venv")
    assert "-e '.[models]'" in models and "'.[test]'" not in models
    assert "-m hybridserve.executor.torch.checkpoints" in models
    # `make test` still fetches the models, on the test extra it installed (one install only).
    test = _make_dry_run("test", tmp_path / "venv")
    assert "-e '.[test]'" in test and "'.[models]'" not in test
    assert "-m hybridserve.executor.torch.checkpoints" in test


# ----- the port, before the model --------------------------------------------------------------


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_port_in_use_is_refused_naming_the_flag(busy_port: int) -> None:
    code, text = _run(["serve", "--executor", "sim", "--port", str(busy_port)])
    assert code == 2
    assert f"--port {busy_port}: 127.0.0.1:{busy_port} is already in use" in text
    assert "pass a free --port" in text


def test_a_port_in_use_is_refused_before_the_torch_model_loads(
    busy_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch", reason="the torch executor needs the models extra")
    from hybridserve.server import torch_backend

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(torch_backend, "serving_backend", no_load)
    code, text = _run(["serve", "--model", "smollm2", "--port", str(busy_port)])
    assert code == 2 and f"--port {busy_port}" in text and "already in use" in text


# ----- the first Ctrl-C ------------------------------------------------------------------------


def test_shutdown_message_says_how_long_for_how_many_and_how_to_stop_now() -> None:
    from hybridserve.server.runner import shutdown_message

    assert shutdown_message(30.0, 2) == (
        "shutting down: waiting up to 30 s for 2 running requests; Ctrl-C again to stop now"
    )
    assert shutdown_message(1.5, 1).startswith("shutting down: waiting up to 1.5 s for 1 running")
    assert shutdown_message(30.0, 0) == "shutting down: no running requests"


def test_the_first_signal_prints_the_shutdown_message_at_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    backend = SimServingBackend(max_model_len=4096)
    server_app = build_app(backend, ServerSettings(shutdown_timeout_s=7.0))
    state = server_app.state.hybridserve
    server = HybridServer(server_config(server_app, host="127.0.0.1", port=8000), state)
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and not server.force_exit
    assert capsys.readouterr().err.strip() == "shutting down: no running requests"
