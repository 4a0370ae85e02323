"""`hybridserve fleet-sweep`: the grid replicas x router x P:D x preset, run here and on Ray,
its rows, its plot, and the same rows on the same seed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hybridserve.cli import app
from hybridserve.core.errors import ConfigError
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.fleet_sweep import FleetOptions, FleetPoint, fleet_grid, point_config
from hybridserve.sim.workload import AgentParams

runner = CliRunner()
GRID = ["fleet-sweep", "--replicas", "1,2", "--routers", "round-robin,session", "--pd", "1:1"]
TINY = ["--agents", "2", "--duration", "40", "--warmup", "5", "--json"]


def _sweep(args: list[str], out: Path) -> dict[str, Any]:
    result = runner.invoke(app, [*args, *TINY, "--out", str(out)])
    assert result.exit_code == 0, result.output
    payload: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return payload


def test_the_grid_runs_each_router_on_each_colocated_size_and_split_in_order() -> None:
    points = fleet_grid(replicas=[1, 2, 2], routers=["session", "prefix-fa"], pd=[(1, 3)])
    shapes = [(p.router, p.replicas, p.layout) for p in points]
    assert shapes == [
        ("session", 1, "colocated"),
        ("session", 2, "colocated"),
        ("session", 4, "1:3"),
        ("prefix-fa", 1, "colocated"),
        ("prefix-fa", 2, "colocated"),
        ("prefix-fa", 4, "1:3"),
    ]


def test_a_bad_axis_is_named_with_its_flag() -> None:
    with pytest.raises(ConfigError, match=r"routers \(--routers\)='random'"):
        fleet_grid(replicas=[2], routers=["random"])
    with pytest.raises(ConfigError, match=r"presets \(--presets\)='fast'"):
        fleet_grid(replicas=[2], routers=["session"], presets=["fast"])
    with pytest.raises(ConfigError, match="replicas"):
        fleet_grid(replicas=[], routers=["session"], pd=[])
    with pytest.raises(ConfigError, match="replicas"):
        fleet_grid(replicas=[0], routers=["session"])
    result = runner.invoke(app, ["fleet-sweep", "--replicas", "two", *TINY])
    assert result.exit_code == 2 and "--replicas" in result.output and "1,2,4" in result.output


def test_agents_per_gpu_grows_the_load_with_the_fleet() -> None:
    base = SimConfig(agents=AgentParams(num_agents=3), duration_s=40.0, warmup_s=5.0)
    point = FleetPoint(replicas=4, router="session", pd=(1, 3), preset="baseline")
    config = point_config(base, point, FleetOptions(agents_per_gpu=5, pd_link="ib-ndr"))
    assert config.agents.num_agents == 20 and config.preset == "baseline"
    assert config.fleet is not None and config.fleet.pd == (1, 3)
    assert config.fleet.pd_link == "ib-ndr"
    assert point_config(base, point, FleetOptions()).agents.num_agents == 3


def test_a_local_fleet_sweep_writes_its_rows_and_plot_and_repeats_on_a_seed(
    tmp_path: Path,
) -> None:
    first = _sweep(GRID, tmp_path / "a")
    rows = first["rows"]
    shapes = [(r["router"], r["layout"], r["gpus"]) for r in rows]
    assert shapes == [
        ("round-robin", "colocated", 1),
        ("round-robin", "colocated", 2),
        ("round-robin", "1:1", 2),
        ("session", "colocated", 1),
        ("session", "colocated", 2),
        ("session", "1:1", 2),
    ]
    for r in rows:
        assert r["requests_completed"] > 0 and r["agents"] == 2
        assert r["hit_rate"] <= r["global_ideal_hit_rate"] + 1e-9
    assert rows[2]["transfer_ms_mean"] is not None  # the P:D row moved KV over the link
    # One replica: every router routes alike.
    assert {k: v for k, v in rows[0].items() if k != "router"} == {
        k: v for k, v in rows[3].items() if k != "router"
    }
    plot = tmp_path / "a" / "fleet_sweep.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads((tmp_path / "a" / "fleet_sweep.json").read_text())
    assert written["rows"] == rows and written["setup"] == first["setup"]
    again = _sweep(GRID, tmp_path / "b")
    assert json.dumps(again["rows"]) == json.dumps(rows)
    other = _sweep([*GRID, "--seed", "1"], tmp_path / "c")
    assert json.dumps(other["rows"]) != json.dumps(rows)


def test_a_fleet_sweep_on_ray_gives_the_local_rows(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray", reason="Ray is the optional ray extra")
    grid = ["fleet-sweep", "--replicas", "2", "--routers", "prefix-hybrid", "--pd", "1:1"]
    local = _sweep(grid, tmp_path / "local")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = _sweep([*grid, "--ray", "connected"], tmp_path / "ray")
    finally:
        ray.shutdown()
    assert [r["layout"] for r in remote["rows"]] == ["colocated", "1:1"]
    assert json.dumps(remote["rows"]) == json.dumps(local["rows"])
    assert (tmp_path / "ray" / "fleet_sweep.png").is_file()


def test_the_table_has_a_row_per_point_and_names_the_files(tmp_path: Path) -> None:
    args = ["fleet-sweep", "--replicas", "2", "--routers", "session", "--pd", "1:1"]
    args += ["--agents", "2", "--duration", "40", "--warmup", "5", "--out", str(tmp_path)]
    result = runner.invoke(app, args, terminal_width=200)
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if "session" in line]
    assert len(rows) == 2 and "colocated" in rows[0] and "1:1" in rows[1]
    flat = " ".join(result.stdout.split())  # the console may wrap the line
    assert f"files: {tmp_path / 'fleet_sweep.json'}, {tmp_path / 'fleet_sweep.png'}" in flat
