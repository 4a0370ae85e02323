"""Llama and Gemma 3 under the TorchExecutor equal transformers on tiny random checkpoints.

CPU float32: greedy tokens identical, logits within 1e-4; under chunked prefill of a mixed
batch, prefix-cache resume, preemption with recompute and n-gram speculation.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.reference.helpers import (
    GreedyChecks,
    drop_earlier_kv,
    make_checkpoint,
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


# A 7-token budget splits blocks (4) and windows (8) at every offset; sliding-window groups
# retain the window before the first prompt's end, so every group hits on a resume. 34 blocks
# force preemption on both: Gemma 3's four groups of one layer each take their own blocks.
CHECKS = GreedyChecks(
    single=(13, 10, 64),
    batch=((5, 11, 23, 37), 8, 7),
    resume_answer=8,
    preempt=(16, 34),
    ngram_answer=24,
)
check_single_request = CHECKS.single_request
check_chunked_batch = CHECKS.chunked_batch
check_prefix_resume = CHECKS.prefix_resume
check_preemption = CHECKS.preemption
check_ngram_speculation = CHECKS.ngram_speculation


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
