"""Multi-process gloo groups of 2 and 4 CPU ranks produce the single-process results."""

from __future__ import annotations

import pytest
import torch

from hybridserve.parallel import DcpGroup
from hybridserve.parallel.demo_models import TinyDecoder
from hybridserve.parallel.demo_runner import DecodeScenario, greedy_dense
from hybridserve.parallel.launch import run_ranks
from hybridserve.parallel.mla import mla_attention_dense
from tests.parallel import dcp_workers as w

TIMEOUT_S = 120


@pytest.fixture(scope="module", params=[2, 4], ids=["dcp2", "dcp4"])
def ranks(request: pytest.FixtureRequest) -> list[dict]:
    return run_ranks(w.all_checks, request.param, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def single() -> dict:
    return w.all_checks(DcpGroup())


def dense_causal(q, k, v):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("shd,thd->hst", q, k) * q.shape[-1] ** -0.5
    causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return torch.einsum("hst,thd->shd", probs, v)


def test_single_process_paged_attention_equals_dense_causal_attention(single):
    expected = [dense_causal(*inputs) for inputs in w.gqa_inputs()]
    decode_rows = torch.cat(
        [
            torch.stack([e[n + i] for e, n in zip(expected, w.PROMPT_LENS, strict=True)])
            for i in range(w.DECODE_STEPS)
        ]
    )
    torch.testing.assert_close(single["gqa_i1"]["decode"], decode_rows, rtol=0, atol=1e-10)


@pytest.mark.parametrize("case", ["gqa_i1", "gqa_i2"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_dcp_attention_equals_single_process_attention(ranks, single, case, phase):
    for result in ranks:
        torch.testing.assert_close(result[case][phase], single[case][phase], rtol=0, atol=1e-10)


def test_sparse_mla_gathers_query_rows_for_every_token_prefill_included(ranks, single):
    total_rows = sum(stop - start for _, start, stop in w.MLA_STEPS[1])
    for result in ranks:
        mla = result["sparse_mla"]
        assert mla["gathered_queries"].shape[:2] == (total_rows, w.SPARSE_MLA.num_heads)
        assert (mla["slots"] < 0).any(), "some rows must belong to another rank"
        torch.testing.assert_close(
            mla["gathered_queries"], single["sparse_mla"]["gathered_queries"], rtol=0, atol=1e-12
        )


def test_sparse_mla_gather_then_merge_equals_the_unsharded_result(ranks, single):
    weights, x_a, x_b = w.mla_inputs()
    dense_a = mla_attention_dense(weights, w.SPARSE_MLA, x_a)
    dense_b = mla_attention_dense(weights, w.SPARSE_MLA, x_b)
    expected = torch.cat([dense_b[:16], dense_a, dense_b[16:17], dense_b[17:20]])
    torch.testing.assert_close(single["sparse_mla"]["out"], expected, rtol=0, atol=1e-10)
    for result in ranks:
        torch.testing.assert_close(result["sparse_mla"]["out"], expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("model", sorted(w.MODELS))
def test_greedy_decode_with_sharded_kv_gives_the_unsharded_tokens(ranks, single, model):
    scenario = DecodeScenario()
    decoder = TinyDecoder(w.MODELS[model], seed=w.MODEL_SEED)
    reference = {
        "a": greedy_dense(decoder, list(scenario.prompt_a), scenario.max_new_tokens),
        "b": greedy_dense(decoder, scenario.prompt_b(), scenario.max_new_tokens),
    }
    assert single["tokens"][model] == reference
    for result in ranks:
        assert result["tokens"][model] == reference


def test_a_step_without_rows_returns_an_empty_result_on_every_rank(ranks):
    assert [result["no_rows"] for result in ranks] == [(0, w.HEADS, w.DIM)] * len(ranks)


def test_a_failing_rank_raises_instead_of_hanging_the_group():
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        run_ranks(w.fail_on_rank_one, 2, timeout_s=60)
