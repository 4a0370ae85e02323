"""Llama and Gemma 3 under the TorchExecutor equal transformers on tiny random checkpoints.

CPU float32: greedy tokens identical, logits within 1e-4; under chunked prefill of a mixed
batch, prefix-cache resume, preemption with recompute and n-gram speculation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.reference.helpers import (
    assert_greedy_matches,
    drop_earlier_kv,
    hybrid_generate,
    make_checkpoint,
    random_prompt,
    transformers_greedy,
)


def _llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.1,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )


def _gemma3_config() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        query_pre_attn_scalar=16,
        max_position_embeddings=1024,
        initializer_range=0.1,
        architectures=["Gemma3ForCausalLM"],
    )


CONFIGS = {"llama": _llama_config, "gemma3": _gemma3_config}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = make_checkpoint(CONFIGS[request.param](), folder)
    return folder, hf_model


def check_single_request(folder: Path, hf_model: Any) -> None:
    prompt = random_prompt(13, seed=1)
    run = hybrid_generate(folder, [prompt], max_tokens=10)
    want, want_logits = transformers_greedy(hf_model, prompt, 10)
    assert run.tokens["r0"] == want
    got_logits = torch.stack(run.logits["r0"])
    torch.testing.assert_close(got_logits, torch.stack(want_logits), atol=1e-4, rtol=0)


def check_chunked_batch(folder: Path, hf_model: Any) -> None:
    prompts = [random_prompt(n, seed=n) for n in (5, 11, 23, 37)]
    # A 7-token budget splits blocks (4) and windows (8) at every offset.
    run = hybrid_generate(folder, prompts, max_tokens=8, max_num_batched_tokens=7)
    assert_greedy_matches(hf_model, prompts, run)


def check_prefix_resume(folder: Path, hf_model: Any) -> None:
    # The second prompt extends the first (the next turn of a conversation): sliding-window
    # groups retain the window before the first prompt's end, so every group hits.
    first = random_prompt(30, seed=3)
    prompts = [first, first + random_prompt(9, seed=5)]
    run = hybrid_generate(folder, prompts, max_tokens=8, sequential=True)
    assert run.hit_tokens["r1"] >= 24, "the second request must resume from the shared prefix"
    assert_greedy_matches(hf_model, prompts, run)


def check_preemption(folder: Path, hf_model: Any) -> None:
    prompts = [random_prompt(18, seed=10 + i) for i in range(4)]
    run = hybrid_generate(folder, prompts, max_tokens=16, num_blocks=26)
    assert run.num_preemptions > 0, "num_blocks is meant to force preemption"
    assert_greedy_matches(hf_model, prompts, run)


def check_ngram_speculation(folder: Path, hf_model: Any) -> None:
    motif = random_prompt(6, seed=20)
    prompts = [motif * 4 + random_prompt(3, seed=21), random_prompt(9, seed=22) * 2]
    plain = hybrid_generate(folder, prompts, max_tokens=24)
    spec = hybrid_generate(folder, prompts, max_tokens=24, spec_tokens=3)
    assert spec.num_drafted_steps > 0
    assert spec.tokens == plain.tokens
    assert_greedy_matches(hf_model, prompts, spec)


def test_single_request_tokens_and_logits_match_transformers(checkpoint: Any) -> None:
    check_single_request(*checkpoint)


def test_chunked_prefill_of_mixed_batch_matches_transformers(checkpoint: Any) -> None:
    check_chunked_batch(*checkpoint)


def test_prefix_cache_resume_matches_transformers(checkpoint: Any) -> None:
    check_prefix_resume(*checkpoint)


def test_preemption_and_recompute_continue_identically(checkpoint: Any) -> None:
    check_preemption(*checkpoint)


def test_ngram_speculation_equals_plain_greedy(checkpoint: Any) -> None:
    check_ngram_speculation(*checkpoint)


@pytest.mark.parametrize(
    "check", [check_single_request, check_chunked_batch, check_prefix_resume, check_preemption]
)
def test_comparisons_catch_a_broken_kv_carry(checkpoint: Any, check: Any) -> None:
    with drop_earlier_kv(), pytest.raises(AssertionError):
        check(*checkpoint)


def test_every_registered_model_shares_the_decoder_only_plumbing() -> None:
    from hybridserve.executor.torch.models import base

    base.load_model_class({"architectures": ["LlamaForCausalLM"]})  # imports every model
    package = "hybridserve.executor.torch.models."
    classes = {c for c in base._BY_ARCHITECTURE.values() if c.__module__.startswith(package)}
    assert len(classes) >= 8
    for cls in classes:
        assert issubclass(cls, base.DecoderOnlyLM), cls.__name__
        own = set(vars(cls))
        assert not own & {"forward", "optional_parameters", "tie_weights_after_load"}, cls.__name__
