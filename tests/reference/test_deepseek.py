"""DeepSeek-V3 (MLA + MoE) and DeepSeek-V3.2 (MLA + DSA indexer) under the TorchExecutor equal
transformers on tiny random checkpoints.

CPU float32: greedy tokens identical, logits within 1e-4; one request, chunked prefill of a mixed
batch, prefix-cache resume and preemption. Three checkpoints: V3 with q LoRA, interleaved RoPE
and MoE after one dense layer; V3 with a plain `q_proj`, rotate-half RoPE and MoE everywhere;
V3.2 with yarn RoPE, keeping 8 keys per query out of prompts of 20-40 tokens (a separate test
proves that the sparsity changes the logits).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch.models.deepseek import DeepseekV3ForCausalLM
from tests.reference.helpers import (
    HybridRun,
    hybrid_generate,
    make_checkpoint,
    transformers_greedy,
)

VOCAB = 128
INDEX_TOPK = 8

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 1024,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}


def _v3_config() -> Any:
    """Interleaved RoPE, q LoRA, one dense layer then two MoE layers."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **_COMMON,
        num_hidden_layers=3,
        q_lora_rank=32,
        first_k_dense_replace=1,
        rope_interleave=True,
        architectures=["DeepseekV3ForCausalLM"],
    )


def _v3_plain_q_config() -> Any:
    """`q_proj` instead of q LoRA, rotate-half RoPE, MoE from the first layer."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **_COMMON,
        num_hidden_layers=2,
        q_lora_rank=None,
        first_k_dense_replace=0,
        rope_interleave=False,
        architectures=["DeepseekV3ForCausalLM"],
    )


def _v32_config(index_topk: int = INDEX_TOPK) -> Any:
    """Yarn RoPE (both factors away from 1), which the indexer's rotation shares."""
    from transformers import DeepseekV32Config

    # max_position_embeddings = factor * original_max_position_embeddings, as yarn expects.
    return DeepseekV32Config(
        **{**_COMMON, "max_position_embeddings": 64},
        rope_parameters=dict(YARN),
        num_hidden_layers=2,
        q_lora_rank=32,
        first_k_dense_replace=1,
        index_topk=index_topk,
        index_n_heads=8,
        index_head_dim=16,
        architectures=["DeepseekV32ForCausalLM"],
    )


YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 0.7,
    "beta_fast": 32,
    "beta_slow": 1,
}

CONFIGS = {"v3": _v3_config, "v3_plain_q": _v3_plain_q_config, "v32": _v32_config}


def _randomize_defaults(hf_model: Any, folder: Path) -> None:
    """Norm weights and biases and the router's correction bias start as constants; make them
    random so that a wrong or missing load shows, and save the checkpoint again."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, tensor in [*hf_model.named_parameters(), *hf_model.named_buffers()]:
            if "norm" in name or "e_score_correction_bias" in name:
                tensor.add_(0.2 * torch.randn(tensor.shape, generator=gen))
    hf_model.save_pretrained(str(folder))


def _build(name: str, folder: Path) -> Any:
    hf_model = make_checkpoint(CONFIGS[name](), folder)
    _randomize_defaults(hf_model, folder)
    return hf_model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp(request.param)
    return folder, _build(request.param, folder)


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=gen).tolist()


def _assert_matches(hf_model: Any, prompts: Sequence[Sequence[int]], run: HybridRun) -> None:
    for i, prompt in enumerate(prompts):
        got = run.tokens[f"r{i}"]
        want, want_logits = transformers_greedy(hf_model, prompt, len(got))
        assert got == want, f"request r{i} (prompt of {len(prompt)} tokens) diverged"
        got_logits = torch.stack(run.logits[f"r{i}"])
        torch.testing.assert_close(got_logits, torch.stack(want_logits), atol=1e-4, rtol=0)


def test_single_request_tokens_and_logits_match_transformers(checkpoint: Any) -> None:
    folder, hf_model = checkpoint
    prompt = _prompt(25, seed=1)
    run = hybrid_generate(folder, [prompt], max_tokens=8)
    _assert_matches(hf_model, [prompt], run)


def test_chunked_prefill_of_mixed_batch_matches_transformers(checkpoint: Any) -> None:
    folder, hf_model = checkpoint
    prompts = [_prompt(n, seed=n) for n in (6, 21, 34)]
    # A 7-token budget splits prompts across steps at every offset within the 4-token blocks.
    run = hybrid_generate(folder, prompts, max_tokens=6, max_num_batched_tokens=7)
    _assert_matches(hf_model, prompts, run)


def test_prefix_cache_resume_matches_transformers(checkpoint: Any) -> None:
    folder, hf_model = checkpoint
    first = _prompt(28, seed=3)
    prompts = [first, first + _prompt(9, seed=5)]
    run = hybrid_generate(folder, prompts, max_tokens=6, sequential=True)
    assert run.hit_tokens["r1"] >= 24, "the second request must resume from the shared prefix"
    _assert_matches(hf_model, prompts, run)


def test_preemption_and_recompute_continue_identically(checkpoint: Any) -> None:
    folder, hf_model = checkpoint
    prompts = [_prompt(18, seed=10 + i) for i in range(3)]
    run = hybrid_generate(folder, prompts, max_tokens=12, num_blocks=18)
    assert run.num_preemptions > 0, "num_blocks is meant to force preemption"
    _assert_matches(hf_model, prompts, run)


def test_v32_top_k_sparsity_changes_the_logits(tmp_path: Path) -> None:
    """The same V3.2 weights with index_topk above the context length run dense attention; with
    index_topk=8 the logits must differ (so the matches above exercise the indexer's choice),
    and the dense run must equal transformers run dense as well."""
    sparse_folder = tmp_path / "sparse"
    _build("v32", sparse_folder)
    dense_folder = tmp_path / "dense"
    shutil.copytree(sparse_folder, dense_folder)
    config_path = dense_folder / "config.json"
    config = json.loads(config_path.read_text())
    config["index_topk"] = 4096
    config_path.write_text(json.dumps(config))
    prompt = _prompt(32, seed=11)
    sparse = hybrid_generate(sparse_folder, [prompt], max_tokens=4)
    dense = hybrid_generate(dense_folder, [prompt], max_tokens=4)
    gap = (torch.stack(sparse.logits["r0"]) - torch.stack(dense.logits["r0"])).abs().max()
    assert gap > 1e-2, f"top-{INDEX_TOPK} of 32+ keys changed the logits by only {gap}"
    from transformers import AutoModelForCausalLM

    hf_dense = AutoModelForCausalLM.from_pretrained(str(dense_folder)).eval().float()
    _assert_matches(hf_dense, [prompt], dense)


def test_unsupported_rope_type_is_refused_with_the_field_named() -> None:
    config = _v3_config().to_dict()
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ConfigError, match=r"rope_parameters\.rope_type"):
        DeepseekV3ForCausalLM(config)
