"""A simulation resolves its deployment once: the model profile and the preset are looked up
one time per run, however many engines (a fleet's replicas) and reports it builds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hybridserve.cli import app
from hybridserve.sim import deployment as sim_deployment

runner = CliRunner()
BASE = ["simulate", "--agents", "2", "--duration", "40", "--warmup", "10", "--json"]


def _counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    counts = {"model": 0, "preset": 0}
    get_model, resolve_settings = sim_deployment.get_model, sim_deployment.resolve_settings

    def model(name: str) -> Any:
        counts["model"] += 1
        return get_model(name)

    def preset(*args: Any, **kwargs: Any) -> Any:
        counts["preset"] += 1
        return resolve_settings(*args, **kwargs)

    monkeypatch.setattr(sim_deployment, "get_model", model)
    monkeypatch.setattr(sim_deployment, "resolve_settings", preset)
    return counts


@pytest.mark.parametrize("extra", [[], ["--replicas", "3", "--router", "session"]])
def test_simulate_resolves_the_model_and_the_preset_once(
    monkeypatch: pytest.MonkeyPatch, extra: list[str]
) -> None:
    counts = _counted(monkeypatch)
    result = runner.invoke(app, [*BASE, *extra])
    assert result.exit_code == 0, result.output
    assert counts == {"model": 1, "preset": 1}


def test_a_model_config_file_is_read_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    reads = []
    load = sim_deployment.load_model_profile

    def counted(path: Any) -> Any:
        reads.append(path)
        return load(path)

    monkeypatch.setattr(sim_deployment, "load_model_profile", counted)
    config = str(Path(__file__).parents[2] / "benchmarks" / "configs" / "llama-3.1-8b")
    result = runner.invoke(app, [*BASE, "--model-config", config])
    assert result.exit_code == 0, result.output
    assert len(reads) == 1
