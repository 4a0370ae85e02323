"""The simulated executor, the agent workload and the event loop."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from hybridserve.core.config import SchedulerConfig, SpeculativeConfig
from hybridserve.core.plan import ScheduledChunk, StepPlan
from hybridserve.engine import Engine
from hybridserve.kvcache import CacheLayout, FullAttentionSpec, KVCacheManager, MambaSpec
from hybridserve.scheduler import Scheduler
from hybridserve.sim.executor import SimulatedExecutor
from hybridserve.sim.loop import AgentSimulation
from hybridserve.sim.workload import AgentParams, AgentWorkload, LogNormal


def linear_step_time(plan: StepPlan) -> float:
    return 0.005 + 2e-5 * plan.num_scheduled_tokens


SMALL = AgentParams(
    num_agents=4,
    system_prompt_tokens=1_000,
    task_tokens=LogNormal(median=100, sigma=0.5, low=10, high=400),
    turns_per_job=LogNormal(median=4, sigma=0.3, low=2, high=8),
    output_tokens=LogNormal(median=20, sigma=0.5, low=1, high=80),
    tool_result_tokens=LogNormal(median=60, sigma=0.8, low=1, high=600),
    context_limit=8_192,
)


def simulate(seed: int, *, speculation: bool = False, until_s: float = 60.0):  # type: ignore[no-untyped-def]
    groups = (FullAttentionSpec(block_size=32), MambaSpec(block_size=32))
    speculative = SpeculativeConfig.from_name("mtp", 2) if speculation else SpeculativeConfig()
    cache = KVCacheManager(CacheLayout(groups=groups, num_blocks=4096, speculative=speculative))
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=SMALL.context_limit + 1, max_num_batched_tokens=2048),
        cache,
        num_speculative_tokens=2 if speculation else 0,
    )
    executor = SimulatedExecutor(
        linear_step_time,
        seed=seed,
        num_speculative_tokens=2 if speculation else 0,
        acceptance_rate=0.7,
    )
    sim = AgentSimulation(Engine(scheduler, executor), AgentWorkload(SMALL, seed=seed))
    recorder = sim.run(until_s)
    cache.check_invariants()
    return sim, recorder.summary(window_start_s=10.0, window_end_s=until_s)


def test_same_seed_gives_an_identical_report() -> None:
    assert simulate(3)[1] == simulate(3)[1]
    assert simulate(3)[1] != simulate(4)[1]


def test_agents_complete_jobs_and_reuse_their_growing_prefix() -> None:
    _, summary = simulate(1)
    assert summary["jobs_completed"] > 0 and summary["job_goodput_per_hour"] > 0
    assert summary["prefix_hit_rate"] > 0.5  # turns resend a growing history
    assert summary["itl_p50_ms"] > 0 and summary["ttft_p50_ms"] > 0


def test_a_job_finishes_exactly_when_its_last_turn_does() -> None:
    sim, _ = simulate(2)
    recorder = sim.recorder
    for job in recorder.jobs.values():
        if job.finish_s is None:
            continue
        turns = [r for r in recorder.requests.values() if r.job_id == job.job_id]
        assert len(turns) == job.turns
        assert job.finish_s == max(r.finish_s for r in turns if r.finish_s is not None)


def test_speculative_steps_deliver_several_tokens_as_one_gap() -> None:
    _, plain = simulate(5)
    sim, speculation = simulate(5, speculation=True)
    multi = [r for r in sim.recorder.requests.values() if r.output_tokens > len(r.gaps_s) + 1]
    assert multi, "no step delivered accepted drafts"
    assert speculation["itl_p50_ms"] > 0 and plain["itl_p50_ms"] > 0


def test_simulated_executor_accepts_drafts_with_the_given_probability() -> None:
    executor = SimulatedExecutor(
        lambda plan: 0.01, seed=0, num_speculative_tokens=3, acceptance_rate=0.5
    )
    chunk = ScheduledChunk("r", 10, (1, 2, 3, 4), ((),), True, 3)
    lengths = [
        len(executor.execute(StepPlan(i, (chunk,))).sampled_token_ids["r"]) for i in range(4000)
    ]
    # accepted drafts ~ truncated geometric: E = 0.5 + 0.25 + 0.125 = 0.875, plus the bonus
    assert statistics.mean(lengths) == pytest.approx(1.875, abs=0.05)


@pytest.mark.parametrize(
    ("dist", "mean"),
    [
        (LogNormal(median=150, sigma=1.5, high=8_192), None),
        (LogNormal(median=500, sigma=0.8), 500 * math.exp(0.8**2 / 2)),
        (LogNormal(median=30, sigma=0.7), 30 * math.exp(0.7**2 / 2)),
    ],
)
def test_lognormal_generators_match_their_declared_distribution(
    dist: LogNormal, mean: float | None
) -> None:
    rng = random.Random(7)
    samples = [dist.sample(rng) for _ in range(40_000)]
    assert statistics.median(samples) == pytest.approx(dist.median, rel=0.05)
    if mean is not None:
        assert statistics.mean(samples) == pytest.approx(mean, rel=0.05)
    assert max(samples) <= dist.high


def test_default_agent_parameters_give_long_growing_requests() -> None:
    workload = AgentWorkload(AgentParams(), seed=0)
    job = workload.new_job(0)
    turn = workload.next_turn(job)
    assert turn is not None and len(turn.prompt) >= 12_000 + 50
    workload.after_answer(job, [1, 2, 3])
    second = workload.next_turn(job)
    assert second is not None and second.prompt[: len(turn.prompt)] == turn.prompt


def test_simulate_and_bench_commands_report_the_documented_keys(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import json

    from typer.testing import CliRunner

    from hybridserve.cli import app

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    args = ["--duration", "40", "--warmup", "10", "--agents", "3", "--json"]
    first = runner.invoke(app, ["simulate", *args])
    assert first.exit_code == 0, first.output
    metrics = json.loads(first.stdout)
    for key in (
        "job_goodput_per_hour",
        "jobs_completed",
        "itl_p50_ms",
        "itl_p99_ms",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "prefix_hit_rate",
        "preemptions",
    ):
        assert key in metrics
    assert json.loads(runner.invoke(app, ["simulate", *args]).stdout) == metrics
    bench = runner.invoke(app, ["bench", *args, "--name", "t"])
    assert bench.exit_code == 0, bench.output
    report = json.loads(bench.stdout)
    assert set(report) >= {"baseline", "hybridserve", "ratios"}
    folder = tmp_path / "runs" / "t"
    for name in ("report.json", "itl_cdf.png", "ttft_cdf.png", "goodput.png", "timeline.png"):
        assert (folder / name).stat().st_size > 0, name
    assert any(key.startswith("group1_mamba") for key in report["baseline"])
    bad = runner.invoke(app, ["simulate", "--duration", "5", "--warmup", "10"])
    assert bad.exit_code == 2 and "duration_s" in bad.output


def test_mooncake_replay_keeps_the_trace_arrival_times_and_lengths(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from hybridserve.sim.arrivals import mooncake_arrivals

    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 7, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 300, "output_length": 0, "hash_ids": [1]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    arrivals = list(mooncake_arrivals(path, time_scale=2.0))
    assert [a[0] for a in arrivals] == [0.0, 3.0]
    assert [len(a[2]) for a in arrivals] == [600, 300] and [a[3] for a in arrivals] == [7, 1]
    assert arrivals[0][2][:300] == arrivals[1][2]


def test_poisson_and_azure_workloads_have_the_declared_shape(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hybridserve.sim.arrivals import azure_arrivals, poisson_arrivals

    arrivals = list(
        poisson_arrivals(rate_per_s=4.0, num_requests=4000, input_tokens=8, output_tokens=3, seed=1)
    )
    assert arrivals[-1][0] / len(arrivals) == pytest.approx(0.25, rel=0.05)
    csv_path = tmp_path / "a.csv"
    csv_path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,48,10\n2023-11-16 18:17:05.9799600,30,8\n"
    )
    rows = list(azure_arrivals(csv_path))
    assert [round(r[0], 3) for r in rows] == [0.0, 2.0] and [len(r[2]) for r in rows] == [48, 30]


def test_open_loop_simulation_serves_every_trace_request() -> None:
    from hybridserve.sim.arrivals import poisson_arrivals
    from hybridserve.sim.loop import OpenLoopSimulation

    cache = KVCacheManager(CacheLayout(groups=(FullAttentionSpec(block_size=16),), num_blocks=2048))
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=1024), cache)
    engine = Engine(scheduler, SimulatedExecutor(linear_step_time, seed=0))
    arrivals = poisson_arrivals(
        rate_per_s=5.0, num_requests=50, input_tokens=300, output_tokens=20, seed=0
    )
    recorder = OpenLoopSimulation(engine, arrivals).run(1_000.0)
    assert sum(1 for r in recorder.requests.values() if r.finish_s is not None) == 50
    assert all(r.output_tokens == 20 for r in recorder.requests.values())


def test_sweep_draws_valid_settings_and_picks_the_best_under_the_slo(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from typer.testing import CliRunner

    from hybridserve.cli import app
    from hybridserve.core.config import SchedulerConfig
    from hybridserve.sim.sweep import Trial, best, draw_controls

    rng = random.Random(0)
    for _ in range(200):
        controls = dict(draw_controls(rng, 544))
        SchedulerConfig(**controls)  # type: ignore[arg-type]  # raises if D lacks Cp, etc.
        assert controls["max_num_prefill_tokens_per_step"] % 544 == 0

    def trial(goodput: float, itl: float) -> Trial:
        return Trial((("x", goodput),), {"job_goodput_per_hour": goodput, "itl_p99_ms": itl})

    assert best([trial(10, 50), trial(30, 200), trial(20, 90)], itl_slo_ms=100).overrides == (
        ("x", 20),
    )
    assert best([trial(30, 200), trial(10, 150)], itl_slo_ms=100).overrides == (("x", 10),)
    result = CliRunner().invoke(
        app,
        ["sweep", "--trials", "2", "--agents", "2", "--duration", "30", "--warmup", "5", "--json"]
        + ["--workers", "1"],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert len(payload["trials"]) == 3 and payload["trials"][0]["controls"] == {}


def test_config_file_sets_scheduler_fields_and_retention(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hybridserve.core.errors import ConfigError
    from hybridserve.engine.settings import load_settings_file
    from hybridserve.sim.deployment import SimConfig
    from hybridserve.sim.run import simulated_engine

    path = tmp_path / "run.toml"
    path.write_text(
        "[scheduler]\nmax_num_prefill_tokens_per_step = 1088\nmax_num_partial_prefills = 2\n"
        "decode_prefill_min_decode_steps = 2\n"
        "decode_prefill_max_wait_ms = 500\n[cache]\nretention = 'dense'\n"
    )
    loaded = load_settings_file(path)
    config = SimConfig(preset="baseline", overrides=loaded.scheduler, retention=loaded.retention)
    scheduler = simulated_engine(config).scheduler
    assert scheduler.config.max_num_prefill_tokens_per_step == 1088
    assert scheduler.config.decode_prefill_max_wait_ms == 500.0
    assert scheduler.cache.layout.retention.kind.value == "dense"
    for text, field in (
        ("[scheduler]\nmax_num_seqs = 'many'\n", "scheduler.max_num_seqs"),
        ("[scheduler]\nmax_num_seq = 4\n", "scheduler.max_num_seq"),
        ("[cache]\nretention = 'sometimes'\n", "retention"),
        ("[engine]\nx = 1\n", "config"),
        ("[scheduler\n", "config"),
    ):
        path.write_text(text)
        with pytest.raises(ConfigError, match=field):
            load_settings_file(path)


def test_measured_scheduler_cpu_time_lengthens_every_step() -> None:
    from hybridserve.sim.deployment import SimConfig
    from hybridserve.sim.run import simulate
    from hybridserve.sim.workload import AgentParams

    ticks = iter(range(10**9))
    small = AgentParams(num_agents=2)
    plain = simulate(SimConfig(agents=small, duration_s=30.0, warmup_s=1.0))
    config = SimConfig(agents=small, duration_s=30.0, warmup_s=1.0, include_scheduler_cpu=True)
    # A fake clock that advances 1 ms per read: every step costs 2 ms more.
    slow = simulate(config, cpu_clock=lambda: next(ticks) * 1e-3)
    assert slow["itl_p50_ms"] > plain["itl_p50_ms"] + 1.5


def test_sweep_runs_trials_as_ray_tasks() -> None:
    ray = pytest.importorskip("ray", reason="Ray is the optional ray extra")
    from hybridserve.sim.deployment import SimConfig
    from hybridserve.sim.sweep import sweep
    from hybridserve.sim.workload import AgentParams

    base = SimConfig(agents=AgentParams(num_agents=2), duration_s=20.0, warmup_s=2.0)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = sweep(base, trials=1, quantum=544, seed=3, ray_address="connected")
    finally:
        ray.shutdown()
    local = sweep(base, trials=1, quantum=544, seed=3)
    assert [t.overrides for t in remote] == [t.overrides for t in local]
    # repr: a statistic with no sample is nan, and nan != nan
    assert [repr(t.metrics) for t in remote] == [repr(t.metrics) for t in local]
