"""Model profiles built from Hugging Face config.json files (hybridserve.sim.hf_config)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hybridserve.core.errors import ConfigError
from hybridserve.kvcache.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from hybridserve.sim.hf_config import (
    SUPPORTED_MODEL_TYPES,
    load_model_profile,
    profile_from_hf_config,
)
from hybridserve.sim.model_profiles import MODELS

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_builtin_profile_is_reproduced_from_its_public_config(name: str) -> None:
    built = load_model_profile(CONFIGS / name)
    expected = MODELS[name]
    assert replace(built, name=expected.name, source=expected.source) == expected
    assert built.kv_cache_groups() == expected.kv_cache_groups()


def test_folder_and_file_paths_give_the_same_profile() -> None:
    folder = load_model_profile(CONFIGS / "llama-3.1-8b")
    file = load_model_profile(CONFIGS / "llama-3.1-8b" / "config.json")
    assert folder == file
    assert folder.name == "llama-3.1-8b"


def test_unknown_architecture_error_lists_the_supported_ones() -> None:
    with pytest.raises(ConfigError) as info:
        profile_from_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    assert info.value.field == "model_type"
    for model_type in ("llama", "deepseek_v3", "nemotron_h", "qwen3_next"):
        assert model_type in info.value.fix
    assert len(SUPPORTED_MODEL_TYPES) >= 15


def test_missing_field_is_named_in_the_error() -> None:
    with pytest.raises(ConfigError) as info:
        profile_from_hf_config({"model_type": "llama", "hidden_size": 4096})
    assert info.value.field.startswith("config.")


def test_invalid_json_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="fix the JSON"):
        load_model_profile(tmp_path)


def _mixtral() -> dict[str, object]:
    # mistralai/Mixtral-8x7B-v0.1 config.json
    return {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "sliding_window": None,
        "tie_word_embeddings": False,
    }


def test_mixtral_has_46_7b_parameters_and_one_full_attention_group() -> None:
    profile = profile_from_hf_config(_mixtral())
    assert profile.num_moe_layers == 32 and profile.num_dense_mlp_layers == 0
    assert profile.num_params() == pytest.approx(46.7e9, rel=0.01)  # Mistral's model card
    assert profile.cache_groups() == (FullAttentionSpec(block_size=16),)


def test_qwen3_moe_counts_sparse_layers_and_has_no_shared_expert() -> None:
    # Qwen/Qwen3-30B-A3B config.json
    config = {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "sliding_window": None,
        "use_sliding_window": False,
    }
    profile = profile_from_hf_config(config)
    assert profile.num_moe_layers == 48
    assert profile.moe is not None and profile.moe.shared_intermediate_size == 0
    assert profile.num_params() == pytest.approx(30.5e9, rel=0.02)  # Qwen3-30B-A3B model card


def test_gemma2_alternates_local_and_global_layers() -> None:
    # google/gemma-2-9b config.json
    config = {
        "model_type": "gemma2",
        "hidden_size": 3584,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "intermediate_size": 14336,
        "sliding_window": 4096,
        "vocab_size": 256000,
    }
    profile = profile_from_hf_config(config)
    assert (profile.num_swa_layers, profile.num_full_layers) == (21, 21)
    assert profile.tie_word_embeddings
    assert profile.cache_groups() == (
        SlidingWindowSpec(block_size=16, window=4096),
        FullAttentionSpec(block_size=16),
    )


def test_granite_hybrid_and_bamba_get_one_hybrid_block_size() -> None:
    # ibm-granite/granite-4.0-h-tiny-style config: Mamba2 + attention, MoE with a shared MLP.
    config = {
        "model_type": "granitemoehybrid",
        "hidden_size": 1536,
        "num_hidden_layers": 4,
        "layer_types": ["mamba", "mamba", "mamba", "attention"],
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "mamba_n_heads": 48,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "num_local_experts": 64,
        "num_experts_per_tok": 6,
        "intermediate_size": 512,
        "shared_intermediate_size": 1024,
        "vocab_size": 100352,
        "tie_word_embeddings": True,
    }
    profile = profile_from_hf_config(config)
    assert (profile.num_full_layers, profile.num_recurrent_layers) == (1, 3)
    full, mamba = profile.cache_groups()
    assert isinstance(full, FullAttentionSpec) and isinstance(mamba, MambaSpec)
    assert full.block_size == mamba.block_size and full.block_size % 16 == 0
    kv_page = full.block_size * 2 * 4 * 128 * 2
    assert kv_page >= profile.state_bytes_per_sequence() / 3  # the page holds one state
    bamba = dict(config, model_type="bamba", attn_layer_indices=[3], num_local_experts=0)
    del bamba["layer_types"]
    dense = profile_from_hf_config(bamba)
    assert dense.num_full_layers == 1 and dense.moe is None
    assert dense.intermediate_size == 1024


def test_qwen35_nested_text_config_with_layer_types() -> None:
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "layer_types": ["linear_attention"] * 3
        + ["full_attention"]
        + ["linear_attention"] * 3
        + ["full_attention"],
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "intermediate_size": 3584,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "mtp_num_hidden_layers": 1,
        "vocab_size": 248320,
        "tie_word_embeddings": True,
    }
    profile = profile_from_hf_config({"model_type": "qwen3_5", "text_config": text})
    assert (profile.num_full_layers, profile.num_recurrent_layers) == (2, 6)
    assert profile.num_dense_mlp_layers == 8 and profile.moe is None
    assert profile.num_mtp_layers == 1


def test_config_file_in_benchmarks_is_valid_json() -> None:
    paths = sorted(CONFIGS.glob("*/config.json"))
    # Every folder holds a config (an empty or renamed folder fails instead of passing).
    assert len(paths) == len([d for d in CONFIGS.iterdir() if d.is_dir()]) >= 9
    for path in paths:
        config = json.loads(path.read_text())
        assert isinstance(config, dict) and config.get("model_type"), path
        assert (path.parent / "SOURCE.md").exists()


def test_nemotron_pattern_with_moe_layers_counts_each_kind() -> None:
    config = {
        "model_type": "nemotron_h",
        "hidden_size": 2688,
        "hybrid_override_pattern": "MEMEM*EMEM*E",
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "mamba_num_heads": 64,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "n_groups": 8,
        "conv_kernel": 4,
        "n_routed_experts": 128,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712,
        "vocab_size": 131072,
    }
    profile = profile_from_hf_config(config)
    counts = (profile.num_recurrent_layers, profile.num_full_layers, profile.num_moe_layers)
    assert counts == (5, 2, 5)
    assert profile.num_dense_mlp_layers == 0 and not profile.mlp_gated
    assert profile.attention is not None and profile.attention.head_dim == 128
    assert profile.moe is not None and profile.moe.shared_intermediate_size == 3712
