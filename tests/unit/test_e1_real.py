"""The pure parts of benchmarks/e1_real.py: the server order per seed, the KV pool's mapping to
vLLM's blocks, the log and metrics parsing, and the paired ratios over seeds (no server runs)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.benchmark_module import load_benchmark

pytest.importorskip("httpx", reason="the benchmark's client needs the server extra")
pytest.importorskip("scipy", reason="the t intervals need the sim extra")


SMOLLM2 = {  # SmolLM2-135M's config.json, the fields the pool depends on
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "head_dim": 64,
}
GEMMA3_270M = {
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "hidden_size": 640,
    "head_dim": 256,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
}


@pytest.fixture(scope="module")
def e1() -> ModuleType:
    return load_benchmark("e1_real")


def test_each_seed_rotates_the_server_order(e1: ModuleType) -> None:
    servers = ["baseline", "hybridserve", "vllm"]
    orders = [e1.rotated(servers, seed) for seed in range(4)]
    assert orders[0] == servers
    assert orders[1] == ["hybridserve", "vllm", "baseline"]
    assert orders[2] == ["vllm", "baseline", "hybridserve"]
    assert orders[3] == servers
    assert [order[0] for order in orders[:3]] == servers  # every server goes first once
    assert e1.rotated([], 3) == []


def test_one_gib_holds_the_blocks_vllm_logs_for_smollm2(e1: ModuleType) -> None:
    # vLLM 0.32 (CPU) with VLLM_CPU_KVCACHE_SPACE=1 logs "CPU KV cache size: 23,296 tokens".
    assert e1.kv_bytes_per_block(SMOLLM2, 32) == 30 * 32 * 2 * 3 * 64 * 4 == 1_474_560
    pool = e1.pool_mapping(SMOLLM2, 16_384, 32)
    assert pool["num_blocks"] == 512 and pool["tokens"] == 16_384
    assert pool["usable_tokens"] == 511 * 32  # both engines hold one null block
    assert pool["vllm_cpu_kvcache_space_gib"] == 1
    assert pool["vllm_blocks_in_that_space"] * 32 == 23_296


def test_a_pool_past_one_gib_asks_vllm_for_enough_whole_gib(e1: ModuleType) -> None:
    pool = e1.pool_mapping(SMOLLM2, 40_000, 32)
    assert pool["num_blocks"] == 1_250  # 40,000 / 32
    assert pool["vllm_cpu_kvcache_space_gib"] == 2  # 1,250 x 1,474,560 bytes > 1 GiB
    assert pool["vllm_blocks_in_that_space"] >= pool["num_blocks"]
    with pytest.raises(SystemExit, match="--pool-tokens"):
        e1.pool_mapping(SMOLLM2, 40, 32)


def test_gemma3_pool_blocks_hold_one_layer_of_each_kind_group(e1: ModuleType) -> None:
    # 15 sliding and 3 full layers: vLLM makes groups of 3 layers, a block is 3 layers' pages.
    assert e1.vllm_layers_per_block(GEMMA3_270M) == 3
    assert e1.kv_bytes_per_block(GEMMA3_270M, 32) == 3 * 32 * 2 * 1 * 256 * 4
    assert e1.vllm_layers_per_block({**GEMMA3_270M, "layer_types": ["a"] * 12 + ["b"] * 13}) == 13


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_equal_blocks_are_equal_bytes_on_the_torch_executor(e1: ModuleType, name: str) -> None:
    """hybridserve's torch executor holds vLLM's bytes per block: on Gemma 3 both make six
    groups of three layers and keep layer k of every group in one tensor. The built-in models'
    attention geometry at a tiny vocabulary and MLP (the K/V pages do not depend on them)."""
    torch = pytest.importorskip("torch", reason="the torch executor needs torch")
    transformers = pytest.importorskip("transformers", reason="the configs come from it")
    from hybridserve.executor.torch import TorchExecutor
    from hybridserve.executor.torch.loader import build_model

    torch.set_num_threads(1)
    small = {"vocab_size": 64, "intermediate_size": 64}
    if name == "smollm2":
        config = transformers.LlamaConfig(
            **SMOLLM2, **small, tie_word_embeddings=True, architectures=["LlamaForCausalLM"]
        )
    else:
        config = transformers.Gemma3TextConfig(
            **GEMMA3_270M,
            **small,
            sliding_window=512,
            query_pre_attn_scalar=256,
            architectures=["Gemma3ForCausalLM"],
        )
    torch.manual_seed(0)
    executor = TorchExecutor(
        build_model(config.to_dict()), num_blocks=4, block_size=32, packed_linears=False
    )
    per_block = e1.kv_bytes_per_block(config.to_dict(), 32)
    assert executor.block_bytes == per_block
    assert executor.cache.allocated_bytes() == 4 * per_block
    # 30 layers x 32 tokens x K and V x 3 heads of 64; 3 layers x 32 x 2 x 1 head of 256.
    assert per_block == {"smollm2": 1_474_560, "gemma3-270m": 196_608}[name]


def test_the_vllm_floor_is_one_max_length_request_per_kv_group(e1: ModuleType) -> None:
    # SmolLM2: one full-attention group, 8,192 tokens = 256 blocks, and the null block.
    assert e1.vllm_min_blocks(SMOLLM2, 32, 8192, 8192) == 256 + 1
    # Gemma 3 270M, as vLLM-CPU 0.32 refused 384 blocks ("0.28 GiB KV cache is needed"): one
    # full group of 256 blocks and five window groups of min(511 + 8,192, 8,192) / 32 + 1. With
    # exactly 1,541 it estimated a max length of 8,160: one block more, the null block.
    gemma = {**GEMMA3_270M, "sliding_window": 512}
    assert e1.vllm_min_blocks(gemma, 32, 8192, 8192) == 256 + 5 * 257 + 1
    assert e1.vllm_min_blocks(gemma, 32, 8192, 8192) * e1.kv_bytes_per_block(gemma, 32) > (
        0.28 * 2**30
    )
    assert e1.vllm_min_blocks(gemma, 32, 8192, 256) == 256 + 5 * (24 + 1) + 1  # 256-token budget


def test_vllm_log_and_metrics_are_parsed(e1: ModuleType) -> None:
    log = (
        "INFO [kv_cache_utils.py:2620] Overriding num_gpu_blocks=728 with "
        "num_gpu_blocks_override=512\n"
        "INFO [kv_cache_utils.py:2327] CPU KV cache size: 16,352 tokens, Maximum concurrency\n"
    )
    assert e1.parse_vllm_pool(log) == {
        "blocks_from_memory": 728,
        "num_blocks": 512,
        "logged_tokens": 16_352,
    }
    assert e1.parse_vllm_pool("nothing") == dict.fromkeys(
        ("blocks_from_memory", "num_blocks", "logged_tokens")
    )
    page = (
        "# HELP vllm:num_preemptions_total x\n"
        'vllm:num_preemptions_total{engine="0",model_name="m"} 7.0\n'
        'hybridserve:num_preemptions_total{model_name="m"} 2.0\n'
        'hybridserve:num_preemptions_created{model_name="m"} 1.7e9\n'
    )
    assert e1.preemptions(page) == 9.0
    assert e1.preemptions("# nothing\n") is None


def _run(server: str, seed: int, **metrics: float) -> dict[str, Any]:
    return {"server": server, "agents": 4, "seed": seed, "metrics": metrics}


def test_paired_ratios_are_geometric_means_of_per_seed_ratios(e1: ModuleType) -> None:
    runs = [
        _run("hybridserve", 0, job_goodput_per_hour=200.0),
        _run("hybridserve", 1, job_goodput_per_hour=300.0),
        _run("vllm", 0, job_goodput_per_hour=100.0),
        _run("vllm", 1, job_goodput_per_hour=100.0),
        {"server": "baseline", "agents": 4, "seed": 0, "failed": {"reason": "exited"}},
        _run("baseline", 1, job_goodput_per_hour=150.0),
    ]
    ratios = e1.load_ratios(runs, 4, [0, 1], ["baseline", "hybridserve", "vllm"])
    jobs = ratios["hybridserve/vllm"]["job_goodput_per_hour"]
    assert jobs["per_seed"] == [2.0, 3.0]
    assert jobs["mean"] == pytest.approx(math.sqrt(6), abs=1e-4)
    low, high = jobs["ci95"]
    half = 12.706 * math.log(1.5) / 2  # t(0.975, 1) x stdev of the log ratios / sqrt(2)
    assert low == pytest.approx(math.sqrt(6) * math.exp(-half), rel=1e-3)
    assert high == pytest.approx(math.sqrt(6) * math.exp(half), rel=1e-3)
    assert jobs["hybridserve"] == [200.0, 300.0] and jobs["vllm"] == [100.0, 100.0]
    # The failed baseline run leaves its seed out of the pair, not the whole comparison.
    base = ratios["baseline/vllm"]["job_goodput_per_hour"]
    assert base["per_seed"] == [None, 1.5] and base["usable"] == 1 and base["ci95"] is None
    assert set(ratios) == {"hybridserve/vllm", "baseline/vllm", "hybridserve/baseline"}
    assert set(jobs) >= {"mean", "ci95", "per_seed"}
    assert set(ratios["hybridserve/vllm"]) == set(e1.METRICS)
    only_ours = e1.load_ratios(runs, 4, [0, 1], ["baseline", "hybridserve"])
    assert set(only_ours) == {"hybridserve/baseline"}


def _rows(*cached: int | None) -> list[dict[str, Any]]:
    return [{"id": f"a0.j0.t{i}", "cached_tokens": c} for i, c in enumerate(cached)]


def test_turn_agreement_compares_the_requests_both_servers_finished(e1: ModuleType) -> None:
    baseline = _rows(0, 992, 1984, 2976, None)
    vllm = _rows(0, 992, 1952, None, 3968)
    agreement = e1.turn_agreement(baseline, vllm)
    assert agreement["compared"] == 3  # t3 and t4 finished on one side only
    assert agreement["equal_fraction"] == pytest.approx(2 / 3, abs=1e-4)
    assert agreement["mean_abs_difference"] == pytest.approx(32 / 3, abs=0.01)
    assert agreement["mean"] == [pytest.approx(992.0), pytest.approx(981.33, abs=0.01)]
    assert e1.turn_agreement(baseline, []) == {"compared": 0, "equal_fraction": None}


def test_cache_exactness_pools_the_turns_of_every_seed(e1: ModuleType, tmp_path: Path) -> None:
    runs = []
    for server, seed, rows in (
        ("baseline", 0, _rows(0, 992, 1984)),
        ("vllm", 0, _rows(0, 992, 1984)),
        ("baseline", 1, _rows(0, 992)),
        ("vllm", 1, _rows(0, 960)),
    ):
        path = tmp_path / f"{server}-{seed}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(
            {**_run(server, seed, cached_tokens_per_turn=float(seed)), "requests_file": str(path)}
        )
    check = e1.cache_exactness(runs, 4, [0, 1])
    assert [t["compared"] for t in check["per_turn"]] == [3, 2]
    assert check["per_turn_equal_fraction"] == pytest.approx(4 / 5)
    assert check["cached_tokens_per_turn"]["per_seed"] == {
        "baseline": [0.0, 1.0],
        "vllm": [0.0, 1.0],
    }
    assert check["cached_tokens_per_turn"]["mean"] == {"baseline": 0.5, "vllm": 0.5}


def test_prefix_kept_measures_hits_against_the_reusable_prefix(e1: ModuleType) -> None:
    rows = [  # a job's turns resend its previous prompt; first turns share the system prompt
        {"session": "a0.j0", "prompt_tokens": 1100, "cached_tokens": 0},
        {"session": "a1.j0", "prompt_tokens": 1200, "cached_tokens": 992},
        {"session": "a0.j0", "prompt_tokens": 1500, "cached_tokens": 1088},  # ideal 1088
        {"session": "a1.j0", "prompt_tokens": 1700, "cached_tokens": 992},  # evicted: 1184
        {"session": "a0.j0", "prompt_tokens": 1900, "cached_tokens": None},  # not finished
        {"session": "a0.j0", "prompt_tokens": 2100, "cached_tokens": 1900},  # exact tail
    ]
    kept = e1.prefix_kept(rows, 32, 1000)
    ideal = 0 + 992 + 1088 + 1184 + 1888
    assert kept["turns"] == 5 and kept["turns_short_of_ideal"] == 1
    assert kept["ideal_tokens_per_turn"] == pytest.approx(ideal / 5, abs=0.1)
    assert kept["cached_over_ideal"] == pytest.approx((992 + 1088 + 992 + 1900) / ideal, abs=1e-4)
    assert e1.prefix_kept([], 32, 1000)["cached_over_ideal"] is None


def test_timings_average_start_up_and_agent_seconds_per_server(e1: ModuleType) -> None:
    runs = [
        {"server": "vllm", "startup_s": 70.0, "agents_wall_s": 240.0},
        {"server": "vllm", "startup_s": 80.0, "agents_wall_s": 242.0},
        {"server": "baseline", "failed": {"reason": "exited"}},
    ]
    assert e1.timings(runs) == {"vllm": {"startup_s": 75.0, "agents_s": 241.0, "per_run_s": 316.0}}


def test_quick_mode_is_one_load_two_seeds_and_short_runs(e1: ModuleType) -> None:
    args = e1.parse_args(["--quick", "--servers", "baseline,hybridserve"])
    assert (args.agents, args.seeds, args.duration, args.warmup) == ([4], 2, 60.0, 15.0)
    assert args.servers == ["baseline", "hybridserve"]
    with pytest.raises(SystemExit):
        e1.parse_args(["--servers", "baseline,sglang"])


SETUP = {
    "model": "smollm2", "duration": 210.0, "warmup": 30.0, "pool_tokens": 12_288,
    "block_size": 32, "max_model_len": 8_192, "threads": 2, "time_scale": 0.2,
    "system_prompt_tokens": 1_000, "max_context": 6_000, "output_tokens": 32,
    "tool_result_tokens": 150,
}  # fmt: skip


def _report(tmp_path: Path, name: str, runs: list[dict[str, Any]], **setup: Any) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"setup": SETUP | setup, "runs": runs}))
    return path


def test_merged_seeds_and_loads_are_one_report(e1: ModuleType, tmp_path: Path) -> None:
    first = [
        _run(s, seed, job_goodput_per_hour=100.0)
        for s in ("hybridserve", "vllm")
        for seed in (0, 1)
    ]
    later = [
        _run("hybridserve", 2, job_goodput_per_hour=400.0),
        _run("vllm", 2, job_goodput_per_hour=100.0),
    ]
    runs = e1.merged_runs(_report(tmp_path, "a.json", first), SETUP) + later
    report = e1.summarise(SETUP, {"num_blocks": 384}, runs)
    jobs = report["ratios"]["4"]["hybridserve/vllm"]["job_goodput_per_hour"]
    assert jobs["per_seed"] == [1.0, 1.0, 4.0]  # seeds 0 and 1 merged, seed 2 run here
    assert report["setup"]["seeds"] == {"4": [0, 1, 2]} and report["setup"]["agents"] == [4]
    with pytest.raises(SystemExit, match="given twice"):
        e1.summarise(SETUP, {}, runs + later[:1])


def test_a_report_of_another_workload_is_not_merged(e1: ModuleType, tmp_path: Path) -> None:
    other = _report(tmp_path, "b.json", [], max_context=3_000)
    with pytest.raises(SystemExit, match="max_context 3000 here 6000"):
        e1.merged_runs(other, SETUP)
    # Runs with the server's own answers are another workload than drawn answers (a merged
    # report's setup is the merging run's: its fidelity twins would draw the answers).
    served = _report(tmp_path, "d.json", [], answers="server")
    with pytest.raises(SystemExit, match="answers 'server' here 'synthetic'"):
        e1.merged_runs(served, SETUP | {"answers": "synthetic"})
    assert e1.merged_runs(served, SETUP | {"answers": "server"}) == []
    assert e1.merged_runs(_report(tmp_path, "e.json", []), SETUP | {"answers": "synthetic"}) == []
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(SystemExit, match="not an e1_real report"):
        e1.merged_runs(tmp_path / "c.json", SETUP)


def test_seeds_can_start_past_zero(e1: ModuleType) -> None:
    args = e1.parse_args(["--seeds", "2", "--first-seed", "3", "--agents", "12"])
    assert (args.first_seed, args.seeds) == (3, 2)
    with pytest.raises(SystemExit):
        e1.parse_args(["--first-seed", "-1"])


def test_tables_show_each_servers_seeds_and_the_paired_ratios(e1: ModuleType) -> None:
    runs = [
        _run("hybridserve", s, output_tokens_per_s=v, itl_p50_ms=500.0)
        for s, v in ((0, 6.0), (1, 8.0))
    ] + [_run("vllm", s, output_tokens_per_s=10.0, itl_p50_ms=100.0) for s in (0, 1)]
    report = e1.summarise(SETUP, {}, runs)
    text = e1.markdown_tables(report)
    assert "### 4 agents, seeds 0, 1" in text
    assert "| hybridserve | - | - | 7.00 [6.00, 8.00] | - | - | 500 [500, 500] |" in text
    assert "| hybridserve/vllm | - | 0.69 [" in text  # sqrt(0.6 x 0.8), jobs not measured
    assert "| baseline |" not in text  # no runs: no row


def test_engine_counters_are_read_from_the_prometheus_page(e1: ModuleType) -> None:
    page = "\n".join(
        [
            "# HELP hybridserve:engine_steps_total Engine steps.",
            'hybridserve:engine_steps_total{model_name="smollm2"} 812.0',
            'hybridserve:engine_step_seconds_total{model_name="smollm2"} 171.5',
            'hybridserve:engine_step_seconds_created{model_name="smollm2"} 1.7e9',
            'hybridserve:generation_tokens_total{model_name="smollm2"} 1500.0',
            'vllm:num_preemptions_total{model_name="smollm2"} 3.0',
        ]
    )
    assert e1.engine_counters(page) == {
        "engine_steps": 812.0,
        "engine_step_seconds": 171.5,
        "generation_tokens": 1500.0,
    }


def test_answers_reach_the_agents_command(e1: ModuleType) -> None:
    for answers in ("synthetic", "server"):
        args = e1.parse_args(["--answers", answers])
        command = e1.agents_command(args, "http://127.0.0.1:1", 4, 0, Path("out"))
        assert command[command.index("--answers") + 1] == answers
    with pytest.raises(SystemExit):
        e1.parse_args(["--answers", "echo"])
