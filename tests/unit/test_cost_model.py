"""The GPU cost model: roofline terms, their regimes, parallelism terms and the KV pool size."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import ScheduledChunk, StepPlan
from hybridserve.layouts import get_layout
from hybridserve.sim.cost_model import (
    Efficiency,
    RequestShape,
    RooflineCostModel,
    StepShape,
    bytes_per_block,
    causal_pairs,
    expected_experts,
    kv_pool_blocks,
    shape_from_plan,
)
from hybridserve.sim.gpus import GPUS, get_gpu
from hybridserve.sim.memory import vllm_memory_account
from hybridserve.sim.model_profiles import MODELS, get_model, hybrid_block_size

H100 = get_gpu("H100-SXM")
H200 = get_gpu("H200")


def model_cost(name: str, *, gpu: str = "H200", tp: int = 1, dcp: int = 1) -> RooflineCostModel:
    return RooflineCostModel(get_gpu(gpu), get_model(name), tp=tp, dcp=dcp)


def test_step_time_rises_with_prefill_tokens() -> None:
    cm = model_cost("llama-3.1-8b")
    times = [cm.step_cost(StepShape.prefill(n)).total_s for n in (1, 64, 512, 2048, 8192)]
    assert times == sorted(times)
    assert times[-1] > 10 * times[0]


def test_step_time_rises_with_batch_and_context() -> None:
    cm = model_cost("qwen3-next-80b-a3b", tp=2)
    by_context = [
        cm.step_cost(StepShape.decode(batch=32, context_tokens=c)).total_s
        for c in (1_000, 8_000, 32_000, 128_000)
    ]
    by_batch = [
        cm.step_cost(StepShape.decode(batch=b, context_tokens=8_000)).total_s
        for b in (1, 8, 64, 256)
    ]
    assert by_context == sorted(by_context) and by_context[-1] > by_context[0]
    assert by_batch == sorted(by_batch) and by_batch[-1] > by_batch[0]


def test_decode_is_memory_bound_and_prefill_compute_bound_with_crossover_at_ridge() -> None:
    cm = RooflineCostModel(H100, get_model("llama-3.1-8b"))
    eff = Efficiency()
    # Linear layers: compute 2*T*P / (peak*gemm) meets memory 2*P / (bw*hbm) at this many tokens.
    ridge = H100.peak_flops("bf16") / H100.hbm_bytes_per_s  # FLOPs per byte where they meet
    crossover = ridge * 2.0 * eff.gemm / eff.hbm / 2
    assert 150 < crossover < 180  # ~166 tokens on an H100 at bf16 (fitted gemm and hbm)

    def linear(tokens: int) -> float:  # a chunk that samples nothing: no LM head
        return cm.step_cost(StepShape((RequestShape(tokens, 0, 0, False),))).linear_s

    decode = linear(1)
    assert linear(int(crossover)) == pytest.approx(decode)  # still memory-bound
    assert linear(int(2 * crossover)) > 1.9 * decode  # compute-bound: time grows with tokens
    assert linear(int(4 * crossover)) == pytest.approx(2 * linear(int(2 * crossover)), rel=0.01)


def test_decode_attention_is_kv_read_bound() -> None:
    cm = RooflineCostModel(H100, get_model("llama-3.1-8b"))
    short = cm.step_cost(StepShape.decode(batch=16, context_tokens=4_000)).attention_decode_s
    long = cm.step_cost(StepShape.decode(batch=16, context_tokens=8_000)).attention_decode_s
    assert long == pytest.approx(2 * short, rel=0.01)  # proportional to KV bytes read


def test_moe_reads_the_expected_distinct_experts_of_the_batch() -> None:
    cm = model_cost("qwen3-next-80b-a3b", tp=2)
    moe = get_model("qwen3-next-80b-a3b").moe
    assert moe is not None and moe.num_experts == 512 and moe.num_experts_per_tok == 10

    def moe_s(tokens: int) -> float:
        return cm.step_cost(StepShape.decode(batch=tokens, context_tokens=100)).moe_s

    # One token reads exactly its 10 experts; 20 share some: 512 (1 - (1 - 10/512)^20) = 166.9.
    assert expected_experts(512, 10, 1) == pytest.approx(10)
    assert expected_experts(512, 10, 20) == pytest.approx(166.9, abs=0.1)
    assert moe_s(20) == pytest.approx(expected_experts(512, 10, 20) / 10 * moe_s(1))
    assert moe_s(20) < 20 * moe_s(1) * 0.85  # min(E, T*k) would charge 200 experts
    # Large batches touch all 512 experts, and the term stays memory-bound.
    assert moe_s(400) == pytest.approx(512 / 10 * moe_s(1), rel=1e-3)
    assert moe_s(0 + 1) < moe_s(2) < 2 * moe_s(1)


def test_dense_model_has_no_moe_state_or_parallel_terms_at_width_one() -> None:
    cost = model_cost("llama-3.1-8b").step_cost(StepShape.decode(batch=8, context_tokens=100))
    assert cost.moe_s == cost.state_s == cost.tp_allreduce_s == cost.dcp_allgather_s == 0.0


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-next-80b-a3b", "deepseek-v3"])
def test_tensor_parallel_allreduce_is_zero_at_tp1_and_positive_above(name: str) -> None:
    shape = StepShape.decode(batch=8, context_tokens=1_000)
    assert model_cost(name, tp=1).step_cost(shape).tp_allreduce_s == 0.0
    at_2 = model_cost(name, tp=2).step_cost(shape).tp_allreduce_s
    at_8 = model_cost(name, tp=8).step_cost(shape).tp_allreduce_s
    assert 0.0 < at_2 < at_8


@pytest.mark.parametrize("name", ["llama-3.1-8b", "deepseek-v3"])
def test_dcp_allgather_is_zero_at_dcp1_and_positive_above(name: str) -> None:
    shape = StepShape.decode(batch=8, context_tokens=64_000)
    no_dcp = model_cost(name, tp=4).step_cost(shape)
    dcp = model_cost(name, tp=4, dcp=4).step_cost(shape)
    assert no_dcp.dcp_allgather_s == 0.0 < dcp.dcp_allgather_s
    sharded = dcp.attention_decode_s + dcp.mla_s
    whole = no_dcp.attention_decode_s + no_dcp.mla_s
    if name == "llama-3.1-8b":
        # 8 KV heads over 4 TP ranks are not duplicated: DCP has no KV to save, reads the same.
        assert sharded == pytest.approx(whole, rel=1e-3)
    else:
        # Qwen3-Next's 2 KV heads (and an MLA latent) are duplicated across TP 4: DCP shards them.
        assert sharded < 0.6 * whole


def test_dcp_must_divide_tp() -> None:
    with pytest.raises(ConfigError, match="dcp"):
        RooflineCostModel(H200, get_model("llama-3.1-8b"), tp=2, dcp=4)


def test_sliding_window_decode_cost_is_bounded_by_the_window() -> None:
    cm = model_cost("gemma-3-27b")
    costs = [cm.step_cost(StepShape.decode(batch=16, context_tokens=c)) for c in (2_000, 100_000)]
    assert costs[0].sliding_window_s > 0
    assert costs[0].sliding_window_s == pytest.approx(costs[1].sliding_window_s)
    assert costs[1].attention_decode_s > 10 * costs[0].attention_decode_s  # global layers grow


def test_sliding_window_pairs_stop_growing_at_the_window() -> None:
    assert causal_pairs(0, 4, window=None) == 10
    assert causal_pairs(0, 4, window=2) == 1 + 2 + 2 + 2
    assert causal_pairs(10_000, 1, window=1024) == causal_pairs(5_000, 1, window=1024) == 1024


@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "nemotron-h-8b"])
def test_recurrent_state_cost_is_independent_of_context(name: str) -> None:
    cm = model_cost(name, tp=2)
    short, long = (
        cm.step_cost(StepShape.decode(batch=32, context_tokens=c)).state_s for c in (1_000, 200_000)
    )
    assert short > 0 and short == pytest.approx(long)


def test_mla_reads_latent_kv_per_context_token() -> None:
    model = get_model("deepseek-v3")
    mla_group = model.cache_groups()[0]
    assert model.kv_bytes_per_token(mla_group, dtype="bf16") == 61 * (512 + 64) * 2
    cm = RooflineCostModel(H200, model, tp=8, dtype="fp8")
    short, long = (
        cm.step_cost(StepShape.decode(batch=64, context_tokens=c)).mla_s for c in (4_000, 8_000)
    )
    assert long == pytest.approx(2 * short, rel=0.02)


def test_verify_tokens_are_new_tokens_of_a_decode() -> None:
    cm = model_cost("llama-3.1-8b")
    plain = cm.step_cost(StepShape.decode(batch=64, context_tokens=1_000))
    verify = cm.step_cost(StepShape.decode(batch=64, context_tokens=1_000, verify_tokens=4))
    assert verify.attention_prefill_s == 0.0  # still decode work
    assert verify.total_s > plain.total_s


def test_shape_from_plan_uses_chunk_start_and_token_count() -> None:
    chunks = (
        ScheduledChunk("a", 100, tuple(range(512)), ((),), sample=False),
        ScheduledChunk("b", 2_000, (1, 2, 3, 4), ((),), sample=True, num_draft_tokens=3),
    )
    shape = shape_from_plan(StepPlan(step_id=0, chunks=chunks), scheduler_cpu_s=0.002)
    assert shape.requests == (
        RequestShape(512, 100, 0, False),
        RequestShape(4, 2_000, 3, True),
    )
    assert [r.is_decode for r in shape.requests] == [False, True]
    cost = model_cost("llama-3.1-8b").step_cost(shape)
    assert cost.scheduler_s == 0.002


@pytest.mark.parametrize("name", sorted(MODELS))
def test_breakdown_sums_to_total(name: str) -> None:
    tp = 8 if name == "deepseek-v3" else 2
    cm = RooflineCostModel(H200, get_model(name), tp=tp, dcp=2)
    mixed = StepShape(
        (RequestShape(2048, 30_000), *(RequestShape(1, 5_000),) * 40), scheduler_cpu_s=1e-4
    )
    cost = cm.step_cost(mixed)
    assert cost.total_s == pytest.approx(sum(cost.terms().values()))
    assert all(v >= 0 for v in cost.terms().values())
    assert cost.launch_s > 0 and cost.scheduler_s == 1e-4


def test_empty_step_costs_only_the_scheduler() -> None:
    cost = model_cost("llama-3.1-8b").step_cost(StepShape((), scheduler_cpu_s=1e-4))
    assert cost.total_s == 1e-4


def test_kv_pool_blocks_positive_and_decreasing_with_weight_size() -> None:
    base = get_model("llama-3.1-8b")
    heavier = dataclasses.replace(base, intermediate_size=2 * base.intermediate_size)
    assert heavier.weight_bytes() > base.weight_bytes()
    blocks = kv_pool_blocks(H200, base, tp=1)
    assert 0 < kv_pool_blocks(H200, heavier, tp=1) < blocks
    # vLLM's account: 139.81 GiB x 0.9 - 16.06 GB weights - the profile run's peak (256 seqs of
    # 128,256 logits, 8,192 tokens x 4,096) - 0.13 GiB, over 16 tokens x 128 KiB per block.
    gib = 2.0**30
    peak = 38.2 * 256 * 128_256 + 2.69 * 8192 * 4096
    free = 139.81 * gib * 0.9 - base.weight_bytes() - peak - 0.13 * gib
    assert blocks == int(free // (16 * 32 * 2 * 8 * 128 * 2))


def test_kv_pool_rejects_a_model_that_does_not_fit() -> None:
    qwen = get_model("qwen3-next-80b-a3b")
    with pytest.raises(ConfigError, match="raise tp"):
        kv_pool_blocks(H200, qwen, tp=1)  # ~159 GB of bf16 weights
    assert kv_pool_blocks(H200, qwen, tp=2) > 0


def test_cache_groups_match_the_named_profiles() -> None:
    for name in ("llama-3.1-8b", "gemma-3-27b", "qwen3-next-80b-a3b"):
        assert get_model(name).cache_groups() == get_layout(name).groups


def test_kv_cache_groups_split_each_kind_into_equal_layer_groups_as_vllm_does() -> None:
    kinds = {
        name: [g.kind.value for g in get_model(name).kv_cache_groups()]
        for name in ("llama-3.1-8b", "gemma-3-27b", "qwen3-next-80b-a3b", "nemotron-h-8b")
    }
    assert kinds["llama-3.1-8b"] == ["full"]
    # 52 sliding-window layers in groups of 10 (the last padded), then the 10 global layers.
    assert kinds["gemma-3-27b"] == ["swa"] * 6 + ["full"]
    # 12 attention layers + the MTP layer = 13 per group; 36 GDN layers -> 3 groups.
    assert get_model("qwen3-next-80b-a3b").layers_per_kv_group == 13
    assert kinds["qwen3-next-80b-a3b"] == ["full"] + ["mamba"] * 3
    assert kinds["nemotron-h-8b"] == ["full"] + ["mamba"] * 6


def test_a_block_id_costs_one_padded_page_per_layer_of_a_group() -> None:
    qwen = get_model("qwen3-next-80b-a3b")
    attention_page = 544 * 2 * 2 * 256 * 2  # 544 tokens x K,V x 2 heads x 256 x bf16
    assert attention_page >= qwen.page_bytes_per_layer(qwen.cache_groups()[1])  # state fits
    assert bytes_per_block(qwen) == 13 * attention_page
    gemma = get_model("gemma-3-27b")
    assert bytes_per_block(gemma) == 10 * 16 * 2 * 16 * 128 * 2
    # The pool counts block ids: what vLLM's memory account leaves, over the per-id bytes.
    account = vllm_memory_account(H200, qwen, dtype="fp8")
    assert kv_pool_blocks(H200, qwen, dtype="fp8") == int(
        account.available_bytes // (13 * attention_page)
    )


def test_hybrid_block_size_rule_reproduces_qwen3_next_and_sizes_nemotron_h() -> None:
    qwen = get_model("qwen3-next-80b-a3b")
    assert qwen.recurrent is not None
    assert hybrid_block_size(qwen.recurrent.state_elems() * 2, 2 * 2 * 256 * 2) == 544
    assert [g.block_size for g in get_model("nemotron-h-8b").cache_groups()] == [528, 528]


@pytest.mark.parametrize(
    ("name", "billions"),
    [("llama-3.1-8b", 8.03), ("gemma-3-27b", 27.0), ("qwen3-next-80b-a3b", 79.7),
     ("nemotron-h-8b", 8.1), ("deepseek-v3", 671.0)],
)  # fmt: skip
def test_parameter_counts_match_published_sizes(name: str, billions: float) -> None:
    assert get_model(name).num_params() / 1e9 == pytest.approx(billions, rel=0.01)


def test_gpu_catalog_holds_datasheet_values() -> None:
    assert sorted(GPUS) == ["A100-80G", "B200", "GH200", "H100-SXM", "H200", "MI300X"]
    assert H200.hbm_bytes_per_s == 4.8e12 and H200.bf16_flops == H100.bf16_flops
    with pytest.raises(ConfigError, match="no fp8"):
        RooflineCostModel(get_gpu("A100-80G"), get_model("llama-3.1-8b"), dtype="fp8")


def test_efficiency_fractions_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"efficiency\.hbm"):
        Efficiency(hbm=1.5)
    with pytest.raises(ConfigError, match=r"efficiency\.kv_hbm"):
        Efficiency(kv_hbm=0.0)
    with pytest.raises(ConfigError, match=r"efficiency\.step_overhead_s"):
        Efficiency(step_overhead_s=-1e-3)


def test_kv_reads_cost_at_their_own_rate_and_only_the_attention_terms_change() -> None:
    """kv_hbm prices the bytes of the KV cache (full, sliding-window and latent attention)
    apart from the weights: None is hbm's rate; a third of it triples a bandwidth-bound
    decode's attention (at most triples a term where some requests are compute-bound) and
    leaves every other term as it was."""
    gpu, shape = get_gpu("H200"), StepShape.decode(batch=32, context_tokens=8192)
    for name in ("llama-3.1-8b", "gemma-3-27b", "deepseek-v3"):
        model = get_model(name)
        base = RooflineCostModel(gpu, model, efficiency=Efficiency(hbm=0.6))
        same = RooflineCostModel(gpu, model, efficiency=Efficiency(hbm=0.6, kv_hbm=0.6))
        slow = RooflineCostModel(gpu, model, efficiency=Efficiency(hbm=0.6, kv_hbm=0.2))
        assert same.step_cost(shape) == base.step_cost(shape)
        before, after = base.step_cost(shape).terms(), slow.step_cost(shape).terms()
        kv_terms = ("attention_decode_s", "sliding_window_s", "mla_s")
        assert any(before[t] > 0 for t in kv_terms)
        for term, seconds in before.items():
            if term not in kv_terms:
                assert after[term] == seconds
            elif seconds > 0:
                assert seconds < after[term] <= 3 * seconds * (1 + 1e-9)
        if name == "llama-3.1-8b":  # grouped-query decode: bound by its KV reads
            assert after["attention_decode_s"] == pytest.approx(
                3 * before["attention_decode_s"], rel=1e-9
            )


def test_cost_model_import_leaves_torch_and_numpy_out() -> None:
    code = (
        "import sys, hybridserve.sim.cost_model, hybridserve.sim.model_profiles, "
        "hybridserve.sim.gpus; "
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_fp32_model_uses_the_fp32_peak_for_gemms_and_attention() -> None:
    cpu = dataclasses.replace(H100, name="cpu", fp32_flops=H100.bf16_flops / 8)
    model = get_model("llama-3.1-8b")
    prefill = StepShape.prefill(4096, context_tokens=8192)
    bf16 = RooflineCostModel(cpu, model, dtype="bf16").step_cost(prefill)
    fp32 = RooflineCostModel(cpu, model, dtype="fp32", kv_dtype="fp32").step_cost(prefill)
    # Compute-bound terms scale with the peak: 8x slower at an eighth of it (the LM head of the
    # one sampled token is memory-bound, hence the tolerance).
    assert fp32.linear_s == pytest.approx(8 * bf16.linear_s, rel=0.01)
    assert fp32.attention_prefill_s == pytest.approx(8 * bf16.attention_prefill_s, rel=1e-9)
    decode = StepShape.decode(batch=1, context_tokens=1000)
    weights_bf16 = RooflineCostModel(cpu, model, dtype="bf16").step_cost(decode).linear_s
    weights_fp32 = RooflineCostModel(cpu, model, dtype="fp32").step_cost(decode).linear_s
    assert weights_fp32 == pytest.approx(2 * weights_bf16, rel=1e-9)  # 4-byte weight reads
    with pytest.raises(ConfigError, match="no fp32 peak"):
        RooflineCostModel(H100, model, dtype="fp32")
