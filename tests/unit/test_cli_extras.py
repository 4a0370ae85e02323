"""A command whose optional extra is missing says exactly which `pip install` brings it, with
the brackets intact; `sweep --ray` failures to reach a cluster are clear errors."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridserve.cli import app


def _invoke(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(app, args)
    assert not isinstance(result.exception, ImportError), result.exception
    return result.exit_code, " ".join(result.output.split())


def test_serve_without_the_server_extra_names_its_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    code, output = _invoke(["serve", "--executor", "sim"])
    assert code == 2
    assert "uvicorn is not installed" in output
    assert "pip install 'hybridserve[server]'" in output


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--model", "smollm2", "--prompts", "prompts.txt"],
        ["calibrate", "--model", "ckpt", "--gpu-name", "cpu"],
    ],
)
def test_torch_commands_without_the_models_extra_name_its_install_command(
    monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    code, output = _invoke(args)
    assert code == 2
    assert "torch is not installed" in output
    assert "pip install 'hybridserve[models]'" in output


def test_dcp_demo_without_torch_names_the_torch_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    code, output = _invoke(["dcp-demo"])
    assert code == 2 and "pip install 'hybridserve[torch]'" in output


def test_plots_skipped_without_matplotlib_name_the_sim_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    workload = "fixed:input=64,output=8,concurrency=2,requests=4"
    code, output = _invoke(
        ["simulate", "--workload", workload, "--spec", "none", "--duration", "30"]
        + ["--warmup", "0", "--out", str(tmp_path), "--json"]
    )
    assert code == 0, output
    assert "plots skipped" in output and "pip install 'hybridserve[sim]'" in output
    assert (tmp_path / "report.json").is_file()


SWEEP = ["sweep", "--trials", "1", "--duration", "20", "--warmup", "0", "--agents", "1"]


def test_sweep_ray_auto_without_a_cluster_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def init(**kwargs: object) -> None:
        raise ConnectionError("Could not find any running Ray instance.")

    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init)
    monkeypatch.setitem(sys.modules, "ray", fake)
    code, output = _invoke([*SWEEP, "--ray", "auto"])
    assert code == 2
    assert "--ray" in output and "'auto'" in output
    assert "ray start --head" in output and "--ray local" in output


def test_sweep_ray_client_address_without_ray_client_names_the_ray_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = types.SimpleNamespace(is_initialized=lambda: False, init=lambda **kw: None)
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setitem(sys.modules, "grpc", None)  # Ray Client's transport is absent
    code, output = _invoke([*SWEEP, "--ray", "ray://127.0.0.1:10001"])
    assert code == 2
    assert "ray[client]" in output and "pip install 'hybridserve[ray]'" in output
