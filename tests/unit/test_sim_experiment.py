"""The simulator as an experiment: vLLM's pool rule and log lines, paired seeds, the bounds,
DCP, draft passes, the time breakdown and `bench`'s JSON interface."""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import ScheduledChunk, StepPlan
from hybridserve.engine.settings import PRESETS
from hybridserve.sim.bounds import bounded_shape, infinite_engine_recorder
from hybridserve.sim.cost_model import RooflineCostModel, StepShape
from hybridserve.sim.deployment import SimConfig
from hybridserve.sim.executor import SimulatedExecutor
from hybridserve.sim.experiment import baseline_preset, paired_report, tune_vllm, tuned_config
from hybridserve.sim.gpus import get_gpu
from hybridserve.sim.memory import (
    GIB,
    MemoryAccount,
    bytes_per_block,
    kv_cache_tokens,
    max_concurrency,
    vllm_log_lines,
    vllm_memory_account,
)
from hybridserve.sim.model_profiles import get_model
from hybridserve.sim.run import pool_memory_account, run_simulation, simulated_engine
from hybridserve.sim.sweep import VLLM_GRID, draw_vllm_setting, vllm_sweep
from hybridserve.sim.workload import AgentParams, AgentWorkload, LogNormal

H200 = get_gpu("H200")
QWEN = get_model("qwen3-next-80b-a3b")

SMALL = AgentParams(
    num_agents=4,
    system_prompt_tokens=2_000,
    task_tokens=LogNormal(median=200, sigma=0.5, low=10, high=800),
    turns_per_job=LogNormal(median=4, sigma=0.3, low=2, high=8),
    output_tokens=LogNormal(median=30, sigma=0.5, low=1, high=120),
    tool_result_tokens=LogNormal(median=100, sigma=0.8, low=1, high=800),
    context_limit=16_384,
)


def short(**fields: object) -> SimConfig:
    base = {"agents": SMALL, "duration_s": 60.0, "warmup_s": 10.0, "seed": 5}
    return SimConfig(**{**base, **fields})  # type: ignore[arg-type]


# ---- the pool as vLLM sizes it -----------------------------------------------------------------


def test_log_lines_reproduce_the_qwen3_next_bf16_tp2_h200_start_up_log() -> None:
    # vLLM 0.10.2, no speculation: 12 attention layers + 36 GDN layers in groups of 12, so
    # 1 attention group and 3 state groups; a page is 544 tokens x K,V x (2 KV heads / TP2)
    # x 256 x bf16 = 557,056 B (the GDN state at TP2, 548,864 B, is padded to it); a block id
    # is 12 such pages: 6,684,672 B. 44.59 GiB of it: 7,162 blocks.
    model = QWEN.loaded(mtp=False)
    groups = model.kv_cache_groups()
    assert [g.kind.value for g in groups] == ["full", "mamba", "mamba", "mamba"]
    assert model.layers_per_kv_group == 12
    assert model.page_bytes_per_layer(groups[1], tp=2) == 548_864
    assert bytes_per_block(model, tp=2) == 12 * 544 * 2 * 1 * 256 * 2 == 6_684_672
    account = MemoryAccount(
        total_bytes=139.81 * GIB,
        gpu_memory_utilization=0.9,
        weight_bytes=139.81 * GIB * 0.9 - 44.59 * GIB,
        activation_bytes=0.0,
        non_torch_bytes=0.0,
        bytes_per_block=bytes_per_block(model, tp=2),
    )
    assert account.num_blocks == 7_162
    # 7,162 // 4 groups x 544 tokens; 262,144 tokens need 482 attention blocks + 3 state blocks.
    assert kv_cache_tokens(7_162, groups) == 973_760
    assert max_concurrency(7_162, groups, 262_144) == pytest.approx(14.77, abs=0.005)
    lines = vllm_log_lines(account=account, num_blocks=7_162, groups=groups, max_model_len=262_144)
    assert lines == [
        "Available KV cache memory: 44.59 GiB",
        "GPU KV cache size: 973,760 tokens",
        "Maximum concurrency for 262,144 tokens per request: 14.77x",
    ]


def test_the_profile_run_rule_predicts_that_pool_within_two_percent() -> None:
    # From first principles (CUDA's 139.81 GiB, weights, the fitted profile-run peak at vLLM's
    # H200 defaults of 1,024 sequences and 8,192 batched tokens, 0.55 GiB non-torch under TP).
    account = vllm_memory_account(
        H200, QWEN.loaded(mtp=False), tp=2, dtype="bf16", max_num_seqs=1024
    )
    assert account.total_bytes == pytest.approx(139.81 * GIB)
    assert account.num_blocks == pytest.approx(7_162, rel=0.02)
    assert account.available_bytes / GIB == pytest.approx(44.59, rel=0.02)


def test_the_sampler_term_matches_vllms_logged_peak_activations() -> None:
    # llm-d's H100 logs at 1,024 sequences; a vLLM log of Llama-3.1-8B at 256 sequences: 1.24 GiB.
    llama = get_model("llama-3.1-8b")
    peak = vllm_memory_account(get_gpu("H100-SXM"), llama, max_num_seqs=1024).activation_bytes
    assert peak / GIB == pytest.approx(4.76, abs=0.05)
    peak = vllm_memory_account(get_gpu("H100-SXM"), llama, max_num_seqs=256).activation_bytes
    assert peak / GIB == pytest.approx(1.24, abs=0.05)


def test_the_mtp_layer_costs_weights_and_a_thirteenth_layer_per_block() -> None:
    with_mtp, without = QWEN, QWEN.loaded(mtp=False)
    assert with_mtp.layers_per_kv_group == 13 and without.layers_per_kv_group == 12
    extra = with_mtp.weight_bytes("fp8") - without.weight_bytes("fp8")
    assert extra == pytest.approx(1.65e9, rel=0.01)  # one attention + 512-expert MoE layer
    mtp_run = pool_memory_account(SimConfig(speculation="mtp"))
    plain_run = pool_memory_account(SimConfig(speculation="none"))
    assert mtp_run.num_blocks < plain_run.num_blocks
    assert mtp_run.bytes_per_block == pytest.approx(13 / 12 * plain_run.bytes_per_block)


def test_fp8_weights_keep_the_embedding_and_lm_head_in_bf16() -> None:
    embed = QWEN.embedding_params()
    body = QWEN.num_params() - embed + QWEN.mtp_layer_params()
    assert QWEN.weight_bytes("fp8") == pytest.approx(body + 2 * embed)


# ---- paired seeds ------------------------------------------------------------------------------


def _draws(workload: AgentWorkload, agent: int, jobs: int) -> list[tuple[int, int, list[int]]]:
    out = []
    for _ in range(jobs):
        job = workload.new_job(agent)
        outputs = []
        while (turn := workload.next_turn(job)) is not None:
            outputs.append(turn.max_tokens)
            workload.after_answer(job, [0] * turn.max_tokens)
        out.append((len(job.history), job.num_turns, outputs))
    return out


def test_each_agent_draws_the_same_jobs_whatever_the_others_do() -> None:
    alone = _draws(AgentWorkload(SMALL, seed=3), 2, 4)
    busy = AgentWorkload(SMALL, seed=3)
    _draws(busy, 0, 7)  # other agents draw first, in another interleaving
    _draws(busy, 1, 2)
    assert _draws(busy, 2, 4) == alone
    assert _draws(AgentWorkload(SMALL, seed=4), 2, 4) != alone


def test_two_presets_on_one_seed_see_identical_job_sequences() -> None:
    runs = {p: run_simulation(short(preset=p)) for p in ("baseline", "hybridserve")}
    base, ours = (runs[p].recorder.requests for p in ("baseline", "hybridserve"))
    common = [r for r in base if r in ours]
    assert len(common) > 20
    for req_id in common:
        assert base[req_id].prompt_tokens == ours[req_id].prompt_tokens, req_id
        if base[req_id].finish_s is not None and ours[req_id].finish_s is not None:
            assert base[req_id].output_tokens == ours[req_id].output_tokens, req_id


# ---- bounds ------------------------------------------------------------------------------------


def _plan(*chunks: ScheduledChunk) -> StepPlan:
    return StepPlan(step_id=0, chunks=chunks)


def test_free_prefill_charges_only_the_decodes_of_a_step() -> None:
    prefill = ScheduledChunk("p", 1000, tuple(range(4096)), (), sample=False)
    decode = ScheduledChunk("d", 5000, (7,), (), sample=True)
    shape = bounded_shape(_plan(prefill, decode), "free-prefill", {})
    assert [(r.num_new_tokens, r.num_context_tokens) for r in shape.requests] == [(1, 5000)]
    assert bounded_shape(_plan(prefill), "free-prefill", {}).requests == ()


def test_ideal_hits_charge_only_the_tokens_no_earlier_request_computed() -> None:
    chunk = ScheduledChunk("p", 1000, tuple(range(4096)), (), sample=True)
    shape = bounded_shape(_plan(chunk), "ideal-hits", {"p": 3000})
    assert [(r.num_new_tokens, r.num_context_tokens) for r in shape.requests] == [(2096, 3000)]
    assert bounded_shape(_plan(chunk), "ideal-hits", {"p": 6000}).requests == ()
    assert bounded_shape(_plan(chunk), "ideal-hits", {}).requests[0].num_new_tokens == 4096


def test_each_bound_switch_changes_the_run_as_it_says() -> None:
    base = run_simulation(short(preset="baseline")).summary
    free = run_simulation(short(preset="baseline", bound="free-prefill")).summary
    ideal = run_simulation(short(preset="baseline", bound="ideal-hits")).summary
    infinite = run_simulation(short(preset="baseline", bound="infinite-engine")).summary
    assert base["gpu_prefill_frac"] + base["gpu_mixed_frac"] > 0
    assert free["gpu_prefill_frac"] < 1e-4 and free["ttft_p50_ms"] < base["ttft_p50_ms"]
    assert ideal["ttft_p50_ms"] < base["ttft_p50_ms"]
    assert infinite["job_tool_frac"] == 1.0 and infinite["steps"] == 0.0
    # Over a window long against a job, tool time alone finishes more jobs than any engine.
    long = {"duration_s": 400.0, "warmup_s": 100.0, "preset": "baseline"}
    slow = run_simulation(short(**long)).summary
    fast = run_simulation(short(**long, bound="infinite-engine")).summary
    assert fast["job_goodput_per_hour"] > slow["job_goodput_per_hour"]
    with pytest.raises(ConfigError, match="bound"):
        short(bound="free-decode")
    with pytest.raises(ConfigError, match="agent workload"):
        short(bound="ideal-hits", workload="poisson:rate=1")


def test_step_cost_bounds_lift_the_token_budget_but_keep_the_pool() -> None:
    from hybridserve.sim.run import simulated_engine

    tuned = short(preset="baseline", overrides=(("max_num_batched_tokens", 2048),))
    real = simulated_engine(tuned).scheduler
    for bound in ("free-prefill", "ideal-hits"):
        lifted = simulated_engine(replace(tuned, bound=bound)).scheduler
        # A whole prompt and every decode with its drafts fit one step: free prompt tokens are
        # never rationed by the budget. The pool is the one the 2,048-token budget leaves.
        budget = lifted.config.max_num_batched_tokens
        assert budget >= real.config.max_model_len + real.config.max_num_seqs * 3
        assert lifted.config.long_prefill_token_threshold == 0
        assert lifted.cache.layout.num_blocks == real.cache.layout.num_blocks
        assert replace(lifted.config, max_num_batched_tokens=2048) == real.config
    assert real.config.max_num_batched_tokens == 2048


def test_the_infinite_engine_runs_every_agents_jobs_back_to_back_on_tool_time() -> None:
    recorder = infinite_engine_recorder(SMALL, seed=1, until_s=120.0)
    for job in recorder.jobs.values():
        turns = [r for r in recorder.requests.values() if r.job_id == job.job_id]
        assert all(r.first_token_s == r.arrival_s == r.finish_s for r in turns)
        if job.finish_s is not None:
            assert job.finish_s == max(r.finish_s or 0.0 for r in turns)


def test_the_breakdown_accounts_for_the_whole_job_time() -> None:
    summary = run_simulation(short(preset="baseline")).summary
    parts = ("job_decode_frac", "job_tool_frac", "job_queue_ttft_frac")
    assert sum(summary[k] for k in parts) == pytest.approx(1.0)
    assert all(summary[k] >= 0 for k in parts)
    gpu = summary["gpu_decode_frac"] + summary["gpu_prefill_frac"] + summary["gpu_mixed_frac"]
    assert gpu == pytest.approx(summary["gpu_busy_frac"]) and 0 < gpu <= 1.0 + 1e-9
    assert summary["recomputed_prompt_tokens_per_turn"] >= summary["ideal_prompt_tokens_per_turn"]
    assert 0 <= summary["slo_attainment"] <= 1


# ---- DCP ---------------------------------------------------------------------------------------


def test_dcp_looks_up_full_attention_in_block_size_times_n_and_replicates_state() -> None:
    scheduler = simulated_engine(short(tp=4, dcp=4)).scheduler
    layout = scheduler.cache.layout
    assert layout.dcp == 4
    assert layout.units == (544 * 4, 544, 544, 544)
    plain = simulated_engine(short(tp=4)).scheduler
    assert plain.cache.layout.units == (544, 544, 544, 544)
    # Per rank: the 2 KV heads are no longer duplicated across 4 TP ranks (each rank keeps
    # both heads of its quarter of the tokens), and the state page is split by TP alone.
    dcp_block = bytes_per_block(QWEN, tp=4, dcp=4)
    assert dcp_block == 13 * 544 * 2 * 2 * 256 * 2
    assert bytes_per_block(QWEN, tp=4) == 13 * 544 * 2 * 1 * 256 * 2


def test_dcp_needs_a_width_that_divides_tp() -> None:
    with pytest.raises(ConfigError, match="dcp"):
        short(tp=2, dcp=4)


def test_dcp_costs_the_lse_merge_collectives_on_the_interconnect() -> None:
    shape = StepShape.decode(batch=16, context_tokens=100_000)
    plain = RooflineCostModel(H200, QWEN, tp=4, dtype="fp8").step_cost(shape)
    sharded = RooflineCostModel(H200, QWEN, tp=4, dcp=4, dtype="fp8").step_cost(shape)
    assert plain.dcp_allgather_s == 0.0 < sharded.dcp_allgather_s
    # 3 ring collectives per attention layer: each at least one collective latency.
    assert sharded.dcp_allgather_s >= 12 * 3 * 10e-6
    faster = dataclasses.replace(H200, link_bytes_per_s=4 * H200.link_bytes_per_s)
    quick = RooflineCostModel(faster, QWEN, tp=4, dcp=4, dtype="fp8").step_cost(shape)
    assert quick.dcp_allgather_s < sharded.dcp_allgather_s
    # The KV read halves: 2 KV heads were duplicated over 4 ranks, now sharded by token.
    assert sharded.attention_decode_s == pytest.approx(plain.attention_decode_s / 2, rel=0.05)


# ---- draft passes and acceptance ---------------------------------------------------------------


def test_mtp_draft_passes_are_charged_in_the_step() -> None:
    verify = StepShape.decode(batch=8, context_tokens=4_000, verify_tokens=3)
    none = RooflineCostModel(H200, QWEN, dtype="fp8").step_cost(verify)
    two = RooflineCostModel(H200, QWEN, dtype="fp8", num_draft_passes=2).step_cost(verify)
    one = RooflineCostModel(H200, QWEN, dtype="fp8", num_draft_passes=1).step_cost(verify)
    assert none.draft_s == 0.0 < one.draft_s < two.draft_s
    assert two.total_s - none.total_s == pytest.approx(two.draft_s)
    # A pass is about one layer of the 48 plus the LM head: far below the target's step.
    assert two.draft_s < 0.3 * none.total_s


def test_acceptance_may_fall_with_context() -> None:
    flat = SimulatedExecutor(lambda plan: 0.0, num_speculative_tokens=2, acceptance_rate=0.7)
    assert flat.acceptance_at(100) == flat.acceptance_at(200_000) == 0.7
    falling = SimulatedExecutor(
        lambda plan: 0.0,
        num_speculative_tokens=2,
        acceptance_rate=0.7,
        acceptance_decay_per_doubling=0.05,
    )
    assert falling.acceptance_at(1024) == 0.7
    assert falling.acceptance_at(4096) == pytest.approx(0.6)
    assert falling.acceptance_at(2**40) == 0.0


# ---- bench ---------------------------------------------------------------------------------


def test_bench_baselines_map_to_presets_or_refuse_clearly() -> None:
    assert baseline_preset("vllm") == baseline_preset("vllm-tuned") == "baseline"
    with pytest.raises(ConfigError, match="use one of"):
        baseline_preset("sglang")
    if "legacy" not in PRESETS:
        with pytest.raises(ConfigError, match="no `legacy` preset"):
            baseline_preset("legacy")


def test_the_vllm_search_draws_only_vllms_knobs() -> None:
    rng = random.Random(0)
    for _ in range(200):
        overrides, retention = draw_vllm_setting(rng, 544)
        knobs = dict(overrides)
        assert set(knobs) == set(VLLM_GRID)
        threshold = knobs["long_prefill_token_threshold"]
        assert threshold == 0 or threshold < knobs["max_num_batched_tokens"]
        assert retention in ("boundary", "interval:2176", "interval:8704")
    trials = vllm_sweep(short(duration_s=40.0), trials=2, quantum=544, seed=1)
    assert len(trials) == 3 and trials[0].overrides == () and trials[0].retention == "boundary"
    assert all(set(dict(t.overrides)) <= set(VLLM_GRID) for t in trials)
    chosen, search = tune_vllm(short(duration_s=40.0), trials=2, itl_slo_ms=1e9, seed=1)
    assert chosen.preset == "baseline" and search["trials"] == 3
    assert set(dict(chosen.overrides)) <= set(VLLM_GRID)
    with pytest.raises(ConfigError, match="vLLM's knobs"):
        tuned_config(short(), {"max_num_partial_prefills": 2}, "boundary")


def test_paired_report_shows_goodput_as_a_fraction_of_each_bound() -> None:
    def row(jobs: float, itl: float, ttft: float, tokens: float) -> dict[str, float]:
        return {
            "job_goodput_per_hour": jobs,
            "itl_p99_ms": itl,
            "ttft_p99_ms": ttft,
            "output_tokens_per_s": tokens,
        }

    rows = {
        "vllm": [row(100.0, 50.0, 9.0, 800.0)] * 2,
        "hybridserve": [row(120.0, 25.0, 9.0, 880.0)] * 2,
        "free-prefill": [row(150.0, 5.0, 1.0, 1000.0)] * 2,
    }
    report = paired_report(rows, baseline="vllm", ours="hybridserve")
    assert report["ratios"]["job_goodput"]["mean"] == 1.2
    assert report["ratios"]["output_tokens"]["mean"] == 1.1
    assert report["ratios"]["itl_p99"]["per_seed"] == [0.5, 0.5]
    assert report["bounds"] == {"free-prefill": 150.0}
    assert report["fraction_of_bound"]["hybridserve"]["free-prefill"]["mean"] == 0.8
    assert "free-prefill" not in report["fraction_of_bound"]


def test_bench_json_prints_the_paired_report_on_its_last_line(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from typer.testing import CliRunner

    from hybridserve.cli import app

    monkeypatch.chdir(tmp_path)
    args = ["--duration", "40", "--warmup", "10", "--agents", "3", "--seeds", "2"]
    result = CliRunner().invoke(app, ["bench", *args, "--workers", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for side in ("baseline", "hybridserve"):
        for key in ("job_goodput_per_hour", "itl_p99_ms", "ttft_p99_ms", "prefix_hit_rate"):
            assert key in report[side], (side, key)
        assert "preemptions" in report[side]
    for name in ("job_goodput", "itl_p99", "ttft_p99", "output_tokens"):
        ratio = report["ratios"][name]
        assert set(ratio) >= {"mean", "ci95", "per_seed"} and len(ratio["per_seed"]) == 2
    assert set(report["bounds"]) == {"free-prefill", "ideal-hits", "infinite-engine"}
    assert report["pool"]["baseline"]["vllm_log"][1].startswith("GPU KV cache size:")
    tuned = tmp_path / "tuned.json"
    best = {"controls": {"max_num_batched_tokens": 2048}, "retention": "boundary"}
    tuned.write_text(json.dumps({"best": best}))
    extra = ["--baseline", "vllm-tuned", "--tuned", str(tuned), "--no-bounds", "--json"]
    result = CliRunner().invoke(app, ["bench", *args, "--workers", "1", *extra])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["setup"]["vllm_tuned"]["best"] == best and report["bounds"] == {}
    tuned.write_text("{}")
    refused = CliRunner().invoke(app, ["bench", *args, *extra])
    assert refused.exit_code != 0 and "--tuned" in refused.output


def test_bench_runs_more_baselines_on_the_same_seeds_with_ratios_to_each(
    tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from typer.testing import CliRunner

    from hybridserve.cli import app

    monkeypatch.chdir(tmp_path)
    tuned = tmp_path / "tuned.json"
    tuned.write_text(json.dumps({"best": {"controls": {"max_num_batched_tokens": 1024}}}))
    small = tmp_path / "small.toml"
    small.write_text("[scheduler]\nmax_num_batched_tokens = 512\n")
    args = ["bench", "--duration", "60", "--warmup", "10", "--agents", "3", "--seeds", "2"]
    args += ["--workers", "1", "--no-bounds", "--tuned", str(tuned)]
    also = ["--also-baselines", "legacy,vllm-tuned", "--json"]

    def bench(*extra: str) -> dict[str, Any]:
        result = CliRunner().invoke(app, [*args, *extra, *also])
        assert result.exit_code == 0, result.output
        report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
        return report

    report = bench()
    assert set(report["ratios_vs"]) == {"legacy", "vllm-tuned"}
    for name, ratios in report["ratios_vs"].items():
        ours = report["hybridserve"]["per_seed_job_goodput_per_hour"]
        theirs = report[name]["per_seed_job_goodput_per_hour"]
        got = ratios["job_goodput"]["per_seed"]
        for a, b, ratio in zip(ours, theirs, got, strict=True):
            assert ratio is None if b == 0 else ratio == pytest.approx(a / b, abs=1e-4)
    assert report["setup"]["vllm_tuned"]["best"]["controls"] == {"max_num_batched_tokens": 1024}
    # A settings file shapes hybridserve only: every baseline runs as without it.
    shaped = bench("--config", str(small))
    for name in ("baseline", "legacy", "vllm-tuned"):
        assert shaped[name] == report[name], name
    assert shaped["hybridserve"] != report["hybridserve"]
    assert shaped["setup"]["labels"]["legacy"] == "legacy"
    for bad, why in (("vllm", "other than --baseline"), ("vllm-fast", "use some of")):
        refused = CliRunner().invoke(app, [*args, "--also-baselines", bad])
        assert refused.exit_code != 0 and why in refused.output, refused.output


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (
            '{"best": {"controls": {"max_num_batched_tokens": "big"}}}',
            "controls.max_num_batched_tokens",
        ),
        (
            '{"best": {"controls": {"max_num_batched_tokens": true}}}',
            "controls.max_num_batched_tokens",
        ),
        ('{"setup": null, "best": {"controls": {"max_num_seqs": 2.5}}}', "controls.max_num_seqs"),
        ('{"best": {"controls": {"kv_pin_fraction": 1}}}', "--tuned ("),
        ('{"best": {"controls": []}}', "--tuned"),
        ("not json", "--tuned"),
    ],
)
def test_a_bad_tuned_file_is_refused_naming_the_flag_and_the_knob(
    tmp_path: Path, text: str, named: str
) -> None:
    from hybridserve.core.errors import ConfigError
    from hybridserve.sim.deployment import SimConfig
    from hybridserve.sim.experiment import read_tuned

    path = tmp_path / "tuned.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        read_tuned(SimConfig(), path)
    assert info.value.field.startswith("--tuned") and named in info.value.field
