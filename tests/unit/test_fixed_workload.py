"""Benchmark-style fixed workloads and the --model-config / --kv-dtype options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridserve.cli import app
from hybridserve.core.errors import ConfigError
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.fixed_workload import FixedWorkload
from hybridserve.sim.run import run_simulation

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def _config(workload: str, **options: object) -> SimConfig:
    base: dict[str, object] = {
        "model_config": str(CONFIGS / "llama-3.1-8b"),
        "gpu": "H100-SXM",
        "dtype": "fp8",
        "speculation": "none",
        "preset": "baseline",
        "duration_s": 600.0,
        "warmup_s": 0.0,
        "workload": workload,
    }
    base.update(options)
    return SimConfig(**base)  # type: ignore[arg-type]


def test_closed_loop_keeps_concurrency_requests_in_flight() -> None:
    run = run_simulation(_config("fixed:input=64,output=20,concurrency=4,requests=10"))
    records = sorted(run.recorder.requests.values(), key=lambda r: r.arrival_s)
    assert len(records) == 10
    assert all(r.output_tokens == 20 and r.prompt_tokens == 64 for r in records)
    assert [r.arrival_s for r in records[:4]] == [0.0] * 4
    finishes = sorted(r.finish_s for r in records if r.finish_s is not None)
    # every later request is sent the moment an earlier one finishes
    assert sorted(r.arrival_s for r in records[4:]) == pytest.approx(finishes[:6])
    assert run.summary["output_tokens_per_s"] == pytest.approx(200 / finishes[-1], rel=1e-4)


def test_batch_one_decode_time_matches_the_cost_model_step() -> None:
    run = run_simulation(_config("fixed:input=128,output=50,concurrency=1,requests=2"))
    assert run.summary["tpot_mean_ms"] == pytest.approx(run.summary["itl_mean_ms"], rel=1e-9)
    # one sequence decoding: weight-read bound, about 8 GB / (0.8 x 3.35 TB/s) at fp8
    assert 2.0 < run.summary["tpot_mean_ms"] < 6.0


def test_poisson_fixed_workload_sends_the_requested_count() -> None:
    run = run_simulation(_config("fixed:input=32,output=8,rate=50,requests=25", seed=3))
    assert run.summary["requests_completed"] == 25
    arrivals = sorted(r.arrival_s for r in run.recorder.requests.values())
    assert arrivals[0] > 0 and arrivals[-1] < 3.0


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("input=1,output=1", "workload"),
        ("input=1,output=1,concurrency=2,rate=1", "workload"),
        ("input=0,output=1,concurrency=2", "workload.input_tokens"),
        ("input=1,output=1,rate=-1", "workload.rate"),
        ("input=1,output=1,speed=3", "workload"),
        ("output=1,concurrency=1", "workload"),
    ],
)
def test_bad_fixed_workload_names_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        FixedWorkload.parse(text)
    assert info.value.field == field


def test_simulate_command_takes_a_model_config_and_kv_dtype() -> None:
    args = [
        "simulate",
        "--model-config",
        str(CONFIGS / "llama-3.1-8b" / "config.json"),
        "--gpu",
        "H100-SXM",
        "--kv-dtype",
        "fp8",
        "--spec",
        "none",
        "--workload",
        "fixed:input=256,output=16,concurrency=2,requests=4",
        "--duration",
        "100",
        "--warmup",
        "0",
        "--json",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)
    for key in ("output_tokens_per_s", "tpot_p50_ms", "tpot_mean_ms", "ttft_mean_ms"):
        assert metrics[key] is not None and metrics[key] > 0, key
    assert "itl_mean_ms" in metrics
    bad = CliRunner().invoke(app, [*args[:2], str(CONFIGS), *args[3:]])
    assert bad.exit_code != 0 and "model_config" in bad.output
