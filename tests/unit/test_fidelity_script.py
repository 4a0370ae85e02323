"""The pure parts of benchmarks/fidelity.py: the simulated twin of a real E1 run (its workload,
pool, pages, scheduler and calibration) and the measured-against-simulated rows (no server runs,
no simulation)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hybridserve.sim.calibration import Calibration
from hybridserve.sim.calibration_fit import fit_measurements, measured_gpu
from hybridserve.sim.cost_model import Efficiency
from hybridserve.sim.fit import CostSetup
from hybridserve.sim.hf_config import profile_from_hf_config
from hybridserve.sim.workload import AgentParams
from tests.benchmark_module import load_benchmark

pytest.importorskip("httpx", reason="the benchmark's server helpers need the server extra")

SETUP = {
    "model": "smollm2", "duration": 210.0, "warmup": 30.0, "max_model_len": 8_192,
    "time_scale": 0.2, "system_prompt_tokens": 1_000, "max_context": 6_000,
    "output_tokens": 32, "tool_result_tokens": 150,
}  # fmt: skip
LLAMA = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 1024,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "vocab_size": 4096, "tie_word_embeddings": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def fid() -> ModuleType:
    return load_benchmark("fidelity")


def test_the_workload_is_the_load_generators_with_tool_times_scaled(fid: ModuleType) -> None:
    params = fid.agent_params(SETUP, 12)
    e1 = AgentParams()
    assert (params.num_agents, params.system_prompt_tokens, params.context_limit) == (
        12,
        1_000,
        6_000,
    )
    assert params.output_tokens.median == 32 and params.tool_result_tokens.median == 150
    assert params.tool_time_fast.median == pytest.approx(e1.tool_time_fast.median * 0.2)
    assert params.tool_time_slow.high == pytest.approx(e1.tool_time_slow.high * 0.2)
    assert params.tool_time_slow.sigma == e1.tool_time_slow.sigma


def twin_inputs(folder: Path) -> tuple[Path, Path]:
    """A small Llama checkpoint (its config only) and a calibration of it, under `folder`: what
    a simulated twin is built from."""
    checkpoint = folder / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(LLAMA))
    return checkpoint, _calibration(folder / "cal.json")


def _calibration(path: Path) -> Path:
    cpu = measured_gpu(
        "cpu", fp32_flops=1.5e11, bf16_flops=1e12, copy_bytes_per_s=1.2e10, memory_bytes=2.4e10
    )
    setup = CostSetup(gpu=cpu, model=profile_from_hf_config(LLAMA), dtype="fp32", kv_dtype="fp32")
    cost = setup.cost_model(Efficiency(gemm=0.5, attention=0.4, hbm=0.6, step_overhead_s=2e-3))
    from hybridserve.sim.calibration_fit import Grid

    shapes = [(s, cost.step_cost(s).total_s) for s in Grid().shapes()]
    fit = fit_measurements(shapes, setup=setup, holdout_fraction=0.25, seed=0)
    Calibration(
        device="cpu", gpu=cpu, peaks="measured", efficiency=fit.efficiency, model="llama",
        dtype="fp32", kv_dtype="fp32", torch_version="2.13.0", torch_device="cpu",
        num_threads=2, clock="wall", seed=0, holdout_fraction=0.25, samples=fit.rows,
        in_sample=fit.in_sample, held_out=fit.held_out,
    ).save(path)  # fmt: skip
    return path


def test_the_twin_has_the_runs_seed_pool_pages_and_scheduler(
    fid: ModuleType, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(LLAMA))
    report = {"setup": SETUP, "pool": {"block_size": 32, "num_blocks": 384}}
    cal = _calibration(tmp_path / "cal.json")
    for engine, preset in (
        ("vllm", "baseline"),
        ("baseline", "baseline"),
        ("hybridserve", "hybridserve"),
    ):
        config = fid.sim_config(report, checkpoint, engine, 4, 3, cal)
        assert config.preset == preset
        assert (config.seed, config.agents.num_agents) == (3, 4)
        assert (config.block_size, config.num_gpu_blocks_override) == (32, 384)
        assert config.answers == "synthetic"  # as the load generator appends them
        assert (config.duration_s, config.warmup_s, config.max_model_len) == (210.0, 30.0, 8_192)
        assert config.calibrated_gpu.name == "cpu" and config.dtype == "fp32"
        assert config.overrides == ()
    # A run whose agents appended the server's own tokens has a twin that appends the engine's.
    echoing = {**report, "setup": {**SETUP, "answers": "server"}}
    assert fid.sim_config(echoing, checkpoint, "baseline", 4, 3, cal).answers == "engine"
    # Runs served before the shipped preset's context weight get twins without it.
    before = fid.sim_config(
        report, checkpoint, "hybridserve", 4, 3, cal, before_context_weight=True
    )
    assert before.overrides == (("adaptive_budget_context_weight", False),)
    assert (
        fid.sim_config(
            report, checkpoint, "baseline", 4, 3, cal, before_context_weight=True
        ).overrides
        == ()
    )


def _run(server: str, seed: int, **metrics: float) -> dict[str, Any]:
    return {"server": server, "agents": 4, "seed": seed, "metrics": metrics}


def test_rows_compare_means_over_the_seeds_both_sides_ran(fid: ModuleType) -> None:
    report = {
        "runs": [
            _run("vllm", 0, output_tokens_per_s=10.0, itl_p50_ms=100.0),
            _run("vllm", 1, output_tokens_per_s=30.0, itl_p50_ms=100.0),
            {"server": "vllm", "agents": 4, "seed": 2, "failed": {"reason": "exited"}},
        ]
    }
    simulated = {
        ("vllm", "vllm-http", 4, 0): {"output_tokens_per_s": 12.0, "itl_p50_ms": 150.0},
        ("vllm", "vllm-http", 4, 1): {"output_tokens_per_s": 32.0, "itl_p50_ms": 150.0},
    }
    rows = {r["metric"]: r for r in fid.fidelity_rows(report, simulated)}
    tokens = rows["output_tokens_per_s"]
    assert (tokens["measured"], tokens["simulated"]) == (20.0, 22.0)
    assert tokens["error"] == pytest.approx(0.1) and tokens["scored"] is True
    assert tokens["per_seed"]["seeds"] == [0, 1]
    assert (tokens["engine"], tokens["calibration"], tokens["load"]) == (
        "vllm",
        "vllm-http",
        "agents=4",
    )
    assert rows["itl_p50_ms"]["error"] == pytest.approx(0.5)
    assert rows["job_goodput_per_hour"]["error"] is None  # measured by neither side here
    table = fid.markdown(list(rows.values()))
    assert "| vllm | vllm-http | agents=4 |" in table
    assert "+10%" in table and "+10% ✗" not in table and "+50% ✗" in table  # goals: 10%, 15%


def test_scaled_tool_times_are_the_same_draws_times_the_scale() -> None:
    import random

    base = AgentParams()
    scaled = base.with_tool_times_scaled(0.2)
    for dist, twin in (
        (base.tool_time_fast, scaled.tool_time_fast),
        (base.tool_time_slow, scaled.tool_time_slow),
    ):
        for seed in range(50):  # the load generator waits draw x scale; the twin draws that
            assert twin.sample(random.Random(seed)) == pytest.approx(
                0.2 * dist.sample(random.Random(seed))
            )
    assert base.with_medians() == base


def test_the_ablation_runs_each_control_off_on_the_presets_twin(
    fid: ModuleType, tmp_path: Path
) -> None:
    """benchmarks/e1_real_ablation.py: every variant at every seed the report ran, each the
    twin of its server with its controls switched off on top of the preset (and valid
    settings: a variant that switched off one control another needs would not build)."""
    ablation = load_benchmark("e1_real_ablation")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(LLAMA))
    report = {
        "setup": SETUP,
        "pool": {"block_size": 32, "num_blocks": 384},
        "runs": [_run("baseline", 0), _run("hybridserve", 0), _run("hybridserve", 1)],
    }
    jobs = ablation.jobs(report, _calibration(tmp_path / "cal.json"), checkpoint)
    assert [(name, seed) for name, seed, _ in jobs] == [
        (name, seed) for name in ablation.VARIANTS for seed in (0, 1)
    ]
    configs = {(name, seed): config for name, seed, config in jobs}
    assert configs["baseline", 1].preset == "baseline" and configs["baseline", 1].overrides == ()
    no_deadline = configs["without the waiting deadline", 0]
    assert no_deadline.preset == "hybridserve"
    assert no_deadline.overrides == (("waiting_deadline_ms", 0.0),)
    from hybridserve.sim.deployment import resolve_deployment

    for (name, _), config in configs.items():
        scheduler = resolve_deployment(config).settings.scheduler
        if name == "without the adaptive budget":
            assert scheduler.adaptive_budget_itl_ms == 0 and scheduler.waiting_deadline_ms > 0
        if name == "without pins":
            assert scheduler.kv_pin_fraction == 0 and not scheduler.kv_pin_exact_tail


def test_e1_runs_between_two_calibrations_are_weighted_by_when_they_ran(fid: ModuleType) -> None:
    before = datetime(2026, 12, 7, 10, 0, tzinfo=UTC).timestamp()
    runs = [
        {"server": "vllm", "agents": 12, "seed": s, "metrics": {}, "began": b, "ended": e}
        for s, b, e in (
            (0, "2026-12-07T10:00:00+00:00", "2026-12-07T10:20:00+00:00"),
            (1, "2026-12-07T11:00:00+00:00", "2026-12-07T11:30:00+00:00"),
        )
    ] + [{"server": "vllm", "agents": 12, "seed": 2, "failed": {"reason": "exited"}}]
    weights = fid.run_weights(runs, (before, before + 7_200.0), "agents")
    assert weights == {("vllm", 12, 0): pytest.approx(1 / 12), ("vllm", 12, 1): 0.625}
    mixed = fid.interpolated(
        weights,
        {("vllm", "vllm-http", 12, 1): {"itl_p50_ms": 80.0}},
        {("vllm", "vllm-http", 12, 1): {"itl_p50_ms": 120.0}},
    )
    assert mixed == {("vllm", "vllm-http", 12, 1): {"itl_p50_ms": pytest.approx(105.0)}}
    untimed = [{"server": "hybridserve", "agents": 4, "seed": 3, "metrics": {}}]
    with pytest.raises(SystemExit, match="hybridserve agents=4 seed 3 has no began/ended"):
        fid.run_weights(untimed, (before, before + 1.0), "agents")


def test_every_calibration_measures_the_shared_prefix_share_it_is_given(
    fid: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands: list[list[str]] = []
    monkeypatch.setattr(fid.subprocess, "run", lambda command, **_: commands.append(command))
    args = fid.parse_args(["--report", "r.json", "--calibrations", str(tmp_path)])
    assert args.decode_shared_fraction == 0.5 and not args.without_shared_kv
    args = fid.parse_args(
        ["--report", "r.json", "--calibrations", str(tmp_path), "--decode-shared-fraction", "0.25"]
    )
    fid.calibrate_own(args, tmp_path / "ckpt")
    flag = commands[0].index("--decode-shared-fraction")
    assert commands[0][flag + 1] == "0.25"
    for bad in ("1.0", "-0.1", "half", "nan"):
        with pytest.raises(SystemExit):
            fid.parse_args(["--report", "r.json", "--decode-shared-fraction", bad])


def shared_twin_inputs(folder: Path) -> tuple[Path, Path]:
    """`twin_inputs` with a calibration whose shared-prefix term is 0.55."""
    checkpoint, cal = twin_inputs(folder)
    data = json.loads(cal.read_text())
    data["efficiency"]["shared_kv"] = 0.55
    cal.write_text(json.dumps(data))
    return checkpoint, cal


def test_the_shared_prefix_term_can_be_left_out_of_every_twin(
    fid: ModuleType, tmp_path: Path
) -> None:
    checkpoint, cal = shared_twin_inputs(tmp_path)
    report = {"setup": SETUP, "pool": {"block_size": 32, "num_blocks": 384}}
    config = fid.sim_config(report, checkpoint, "baseline", 4, 3, cal)
    assert config.efficiency.shared_kv == 0.55
    left_out = fid.without_shared_kv(config)
    assert left_out.efficiency.shared_kv == 0.0
    assert left_out.efficiency.kv_hbm == config.efficiency.kv_hbm
    assert (left_out.seed, left_out.preset) == (config.seed, config.preset)


def test_a_score_says_whether_the_shared_prefix_term_was_left_out(
    fid: ModuleType, tmp_path: Path
) -> None:
    checkpoint, cal = shared_twin_inputs(tmp_path)
    folder = tmp_path / "cals"
    folder.mkdir()
    for name in fid.CALIBRATION_SET:
        (folder / f"{name}.json").write_text(cal.read_text())
    setup = {**SETUP, "duration": 40.0, "warmup": 10.0}
    run = _run("vllm", 0, output_tokens_per_s=1.0) | {"agents": 2}
    report = {"setup": setup, "pool": {"block_size": 32, "num_blocks": 384}, "runs": [run]}
    scored = {}
    for flag in ([], ["--without-shared-kv"]):
        args = fid.parse_args(["--report", "r.json", "--calibrations", str(folder), *flag])
        args.setup, args.workers = setup, 1
        scored[bool(flag)] = fid.score(args, report, checkpoint)
    assert [scored[left].get("shared_kv_left_out") for left in (False, True)] == [False, True]
    assert {r["engine"] for r in scored[True]["rows"]} == {"vllm"}
