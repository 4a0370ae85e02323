"""Qwen3-Next and Qwen3.5 under the TorchExecutor equal transformers on tiny random checkpoints.

CPU float32: greedy tokens identical, logits within 1e-4 (a prefill piece crossing the delta
rule's 64-token chunk); under chunked prefill of a mixed batch (pieces that split blocks at every
offset), prefix-cache resume from a restored recurrent-state snapshot, preemption with recompute
and n-gram speculation (rejected drafts roll the recurrent state back). A zeroed state carry and
a rollback that keeps rejected drafts must be caught.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch import forward as forward_module
from hybridserve.executor.torch.models.qwen3_next import Qwen3NextForCausalLM
from tests.reference.helpers import (
    HybridRun,
    hybrid_generate,
    make_checkpoint,
    transformers_greedy,
)

VOCAB = 96
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]


def _common() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": len(LAYER_TYPES),
        "layer_types": LAYER_TYPES,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 1024,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    }


def _qwen3_next_config() -> Any:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **_common(),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        mlp_only_layers=[1],
        architectures=["Qwen3NextForCausalLM"],
    )


def _qwen3_5_config() -> Any:
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**_common(), architectures=["Qwen3_5ForCausalLM"])


def _qwen3_5_moe_config() -> Any:
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        **_common(),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        architectures=["Qwen3_5MoeForCausalLM"],
    )


CONFIGS = {"qwen3_next": _qwen3_next_config, "qwen3_5": _qwen3_5_config}


def _perturb(model: Any) -> None:
    """Give the (1 + w) norms non-zero weights and the delta rule a slow decay, so that a wrong
    norm offset or a lost state shows in the logits; larger embeddings make greedy outputs
    repeat, so that n-gram drafts get accepted."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.rand(param.shape, generator=gen).mul(0.45).add(0.05).log())
            elif "norm" in name or name.endswith("dt_bias"):
                param.add_(torch.randn(param.shape, generator=gen) * 0.2)
        model.get_input_embeddings().weight.mul_(4.0)


def _saved(hf_model: Any, folder: Path) -> tuple[Path, Any]:
    _perturb(hf_model)
    hf_model.save_pretrained(str(folder))
    return folder, hf_model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp(request.param)
    return _saved(make_checkpoint(CONFIGS[request.param](), folder), folder)


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=gen).tolist()


def _assert_matches(hf_model: Any, prompts: Sequence[Sequence[int]], run: HybridRun) -> None:
    for i, prompt in enumerate(prompts):
        got = run.tokens[f"r{i}"]
        want, _ = transformers_greedy(hf_model, prompt, len(got))
        assert got == want, f"request r{i} (prompt of {len(prompt)} tokens) diverged"


@contextlib.contextmanager
def zero_state_at_chunk_starts() -> Iterator[None]:
    """Break the recurrent-state carry: every chunk starts from a zero state."""
    original = forward_module.ForwardContext.load_state

    def broken(self: Any, layer_index: int, chunk: Any) -> dict[str, torch.Tensor]:
        return {name: torch.zeros_like(t) for name, t in original(self, layer_index, chunk).items()}

    forward_module.ForwardContext.load_state = broken  # type: ignore[method-assign]
    try:
        yield
    finally:
        forward_module.ForwardContext.load_state = original  # type: ignore[method-assign]


@contextlib.contextmanager
def keep_rejected_draft_states() -> Iterator[None]:
    """Break the speculative rollback: every snapshot of a chunk ends up holding the chunk's
    last state, so after a verification step the state includes the rejected drafts."""
    original = forward_module.ForwardContext.save_state

    def broken(
        self: Any, layer_index: int, chunk: Any, num_tokens: int, state: dict[str, torch.Tensor]
    ) -> None:
        for count in chunk.snapshots:
            original(self, layer_index, chunk, count, state)

    forward_module.ForwardContext.save_state = broken  # type: ignore[method-assign]
    try:
        yield
    finally:
        forward_module.ForwardContext.save_state = original  # type: ignore[method-assign]


def check_single_request(folder: Path, hf_model: Any) -> None:
    # Prefill in pieces of 67 and 3 tokens: the first crosses the delta rule's 64-token chunk
    # (and Mamba2's 16-token chunks) and ends inside a block; decoding continues the state.
    prompt = _prompt(70, seed=1)
    run = hybrid_generate(folder, [prompt], max_tokens=8, max_num_batched_tokens=67)
    want, want_logits = transformers_greedy(hf_model, prompt, 8)
    assert run.tokens["r0"] == want
    got_logits = torch.stack(run.logits["r0"])
    torch.testing.assert_close(got_logits, torch.stack(want_logits), atol=1e-4, rtol=0)


def check_chunked_batch(folder: Path, hf_model: Any) -> None:
    prompts = [_prompt(n, seed=n) for n in (5, 11, 30, 70)]
    # A 13-token budget shared by four requests splits blocks (4) at every offset.
    run = hybrid_generate(folder, prompts, max_tokens=6, max_num_batched_tokens=13)
    _assert_matches(hf_model, prompts, run)


def check_prefix_resume(folder: Path, hf_model: Any) -> None:
    first = _prompt(30, seed=3)
    prompts = [first, first + _prompt(9, seed=5)]
    run = hybrid_generate(folder, prompts, max_tokens=6, sequential=True)
    assert run.hit_tokens["r1"] >= 24, "the second request must resume from a state snapshot"
    _assert_matches(hf_model, prompts, run)


def check_preemption(folder: Path, hf_model: Any) -> None:
    prompts = [_prompt(18, seed=10 + i) for i in range(4)]
    run = hybrid_generate(folder, prompts, max_tokens=14, num_blocks=30)
    assert run.num_preemptions > 0, "num_blocks is meant to force preemption"
    _assert_matches(hf_model, prompts, run)


def check_ngram_speculation(folder: Path, hf_model: Any) -> None:
    motif = _prompt(6, seed=20)
    prompts = [motif * 4 + _prompt(3, seed=21), _prompt(9, seed=22) * 2]
    plain = hybrid_generate(folder, prompts, max_tokens=32)
    spec = hybrid_generate(folder, prompts, max_tokens=32, spec_tokens=3)
    # Both rejected drafts (state rolled back) and accepted ones (state committed) occur.
    assert spec.num_accepted_drafts > 0
    assert spec.num_drafted_steps * 3 > spec.num_accepted_drafts
    assert spec.tokens == plain.tokens
    _assert_matches(hf_model, prompts, spec)


def test_single_request_tokens_and_logits_match_transformers(checkpoint: Any) -> None:
    check_single_request(*checkpoint)


def test_chunked_prefill_of_mixed_batch_matches_transformers(checkpoint: Any) -> None:
    check_chunked_batch(*checkpoint)


def test_prefix_cache_resume_from_state_snapshot_matches_transformers(checkpoint: Any) -> None:
    check_prefix_resume(*checkpoint)


def test_preemption_and_recompute_continue_identically(checkpoint: Any) -> None:
    check_preemption(*checkpoint)


def test_ngram_speculation_equals_plain_greedy(checkpoint: Any) -> None:
    check_ngram_speculation(*checkpoint)


@pytest.mark.parametrize("check", [check_single_request, check_chunked_batch, check_prefix_resume])
def test_comparisons_catch_a_zeroed_state_carry(checkpoint: Any, check: Any) -> None:
    with zero_state_at_chunk_starts(), pytest.raises(AssertionError):
        check(*checkpoint)


def test_comparisons_catch_a_rollback_that_keeps_rejected_drafts(checkpoint: Any) -> None:
    with keep_rejected_draft_states(), pytest.raises(AssertionError):
        check_ngram_speculation(*checkpoint)


def test_qwen3_5_moe_text_model_matches_transformers(tmp_path: Path) -> None:
    check_single_request(*_saved(make_checkpoint(_qwen3_5_moe_config(), tmp_path), tmp_path))


def test_qwen3_5_multimodal_checkpoint_serves_text_like_transformers(tmp_path: Path) -> None:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 16,
        "num_heads": 2,
        "out_hidden_size": 32,
        "spatial_merge_size": 1,
    }
    config = Qwen3_5Config(
        text_config=_common(),
        vision_config=vision,
        architectures=["Qwen3_5ForConditionalGeneration"],
    )
    torch.manual_seed(0)
    hf_model = Qwen3_5ForConditionalGeneration(config).eval()
    check_single_request(*_saved(hf_model, tmp_path))


def test_stacked_expert_tensors_load_like_per_expert_ones(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder, hf_model = _saved(make_checkpoint(_qwen3_next_config(), tmp_path / "hf"), tmp_path)
    stacked = {name: t.contiguous() for name, t in hf_model.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in stacked)
    (tmp_path / "stacked").mkdir()
    save_file(stacked, str(tmp_path / "stacked" / "model.safetensors"))
    (tmp_path / "stacked" / "config.json").write_text((folder / "config.json").read_text())
    check_single_request(tmp_path / "stacked", hf_model)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (
            {"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]},
            "config.layer_types[1]",
        ),
        ({"linear_num_value_heads": 3}, "config.linear_num_value_heads"),
        ({"num_experts": 4, "num_experts_per_tok": 5}, "config.num_experts_per_tok"),
        ({"hidden_act": "swish7"}, "config.hidden_act"),
    ],
)
def test_unsupported_config_values_name_the_field(change: dict[str, Any], field: str) -> None:
    config = {**_common(), "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8}
    with pytest.raises(ConfigError) as error:
        Qwen3NextForCausalLM({**config, **change})
    assert error.value.field == field
