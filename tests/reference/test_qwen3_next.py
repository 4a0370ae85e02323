"""Qwen3-Next and Qwen3.5 under the TorchExecutor equal transformers on tiny random checkpoints.

CPU float32: greedy tokens identical, logits within 1e-4 (a prefill piece crossing the delta
rule's 64-token chunk); under chunked prefill of a mixed batch (pieces that split blocks at every
offset), prefix-cache resume from a restored recurrent-state snapshot, preemption with recompute
and n-gram speculation (rejected drafts roll the recurrent state back). A zeroed state carry and
a rollback that keeps rejected drafts must be caught.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch.models.qwen3_next import Qwen3NextForCausalLM
from tests.reference.helpers import make_checkpoint
from tests.reference.state_model_checks import VOCAB, StateModelChecks, check_single_request

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


class TestAgainstTransformers(StateModelChecks):
    """The shared state-model checks on Qwen3-Next and Qwen3.5 (the `checkpoint` fixture)."""


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
