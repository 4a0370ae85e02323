"""Model profiles from Hugging Face `config.json` files: any model of a supported family.

The parser reads the fields each family's transformers/vLLM config class defines and builds a
`ModelProfile` with the cache groups vLLM would allocate: 16-token blocks for plain attention,
64-token blocks for MLA (the FlashMLA block size), and for a model with recurrent state one
block size for every group, `hybrid_block_size` (the attention page grows until it holds one
state page). Block sizes assume a bf16 cache, as the built-in profiles do.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridserve.core.errors import ConfigError
from hybridserve.kvcache.spec import (
    FullAttentionSpec,
    GroupSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)
from hybridserve.sim.model_profiles import (
    AttentionDims,
    GdnDims,
    Mamba2Dims,
    MlaDims,
    ModelProfile,
    MoeDims,
    RecurrentDims,
    hybrid_block_size,
)

_MLA_BLOCK = 64  # vLLM's MLA backends (FlashMLA, CUTLASS MLA) use 64-token blocks
_ATTENTION_BLOCK = 16  # vLLM's default block size for attention-only models


@dataclass(frozen=True, slots=True)
class _Fields:
    """Typed access to one config dict, with errors that name the missing key."""

    data: Mapping[str, Any]
    where: str

    def num(self, key: str, default: int | None = None) -> int:
        value = self.data.get(key, default)
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{self.where}.{key}", value, "give an integer in config.json")
        return int(value)

    def opt_num(self, key: str) -> int | None:
        return None if self.data.get(key) is None else self.num(key)

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)


def load_hf_config(path: Path) -> dict[str, Any]:
    """The JSON object of `path` (a config.json, or a folder holding one). Raises ConfigError."""
    file = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except OSError as exc:
        raise ConfigError(
            "model_config", str(path), f"give a readable config.json ({exc})"
        ) from None
    except json.JSONDecodeError as exc:
        raise ConfigError("model_config", str(file), f"fix the JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("model_config", str(file), "give a JSON object")
    return data


def load_model_profile(path: Path) -> ModelProfile:
    """The profile of the model whose config.json is at `path` (file or folder)."""
    file = path / "config.json" if path.is_dir() else path
    name = file.parent.name if file.name == "config.json" else file.stem
    return profile_from_hf_config(load_hf_config(path), name=name, source=str(file))


def profile_from_hf_config(
    config: Mapping[str, Any], *, name: str = "hf-model", source: str = "config.json"
) -> ModelProfile:
    """Build a ModelProfile from a parsed config.json. Raises ConfigError for an unsupported
    architecture (listing the supported ones) or a missing field."""
    text = config.get("text_config")
    cfg = _Fields(text if isinstance(text, Mapping) else config, "config")
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")
    family = _FAMILIES.get(model_type) or _FAMILIES.get(str(config.get("model_type", "")))
    if family is None:
        raise ConfigError(
            "model_type",
            model_type or config.get("architectures"),
            f"supported model_type values: {', '.join(sorted(_FAMILIES))}",
        )
    return family(cfg, name, source)


def _attention(
    cfg: _Fields, *, output_gate: bool = False, head_dim_key: str = "head_dim"
) -> AttentionDims:
    heads = cfg.num("num_attention_heads")
    head_dim = cfg.opt_num(head_dim_key) or cfg.num("hidden_size") // heads
    kv_heads = cfg.opt_num("num_key_value_heads") or heads
    return AttentionDims(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, output_gate=output_gate
    )


def _groups(
    *,
    attention: AttentionDims | None,
    swa_window: int | None,
    has_full: bool,
    mla: bool = False,
    recurrent: RecurrentDims | None = None,
) -> tuple[GroupSpec, ...]:
    """Cache groups in the built-in profiles' order: sliding window, full (or MLA), state."""
    if recurrent is not None:
        if attention is None:
            raise ConfigError("config.num_attention_heads", None, "a hybrid model needs attention")
        kv_per_token = 2 * attention.num_kv_heads * attention.head_dim * 2
        block = hybrid_block_size(recurrent.state_elems() * 2, kv_per_token)
        return (
            FullAttentionSpec(block_size=block),
            MambaSpec(block_size=block, mode=MambaCacheMode.ALIGN),
        )
    groups: list[GroupSpec] = []
    if swa_window is not None:
        groups.append(SlidingWindowSpec(block_size=_ATTENTION_BLOCK, window=swa_window))
    if mla:
        groups.append(FullAttentionSpec(block_size=_MLA_BLOCK, mla=True))
    elif has_full:
        groups.append(FullAttentionSpec(block_size=_ATTENTION_BLOCK))
    return tuple(groups)


def _common(cfg: _Fields, name: str, source: str, *, tied: bool = False) -> dict[str, Any]:
    return {
        "name": name,
        "source": source,
        "hidden_size": cfg.num("hidden_size"),
        "vocab_size": cfg.num("vocab_size"),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", tied)),
    }


def _dense(cfg: _Fields, name: str, source: str) -> ModelProfile:
    """Llama, Mistral, Qwen2, Qwen3: every layer full attention (Mistral: sliding window when
    `sliding_window` is set) and a SwiGLU MLP."""
    layers = cfg.num("num_hidden_layers")
    attention = _attention(cfg)
    window = cfg.opt_num("sliding_window") if _uses_sliding_window(cfg) else None
    return ModelProfile(
        **_common(cfg, name, source),
        groups=_groups(attention=attention, swa_window=window, has_full=window is None),
        num_full_layers=0 if window else layers,
        num_swa_layers=layers if window else 0,
        sliding_window=window,
        num_dense_mlp_layers=layers,
        attention=attention,
        intermediate_size=cfg.num("intermediate_size"),
    )


def _uses_sliding_window(cfg: _Fields) -> bool:
    # Qwen2/Qwen3 carry a sliding_window value but only use it with use_sliding_window=true.
    if cfg.get("sliding_window") is None:
        return False
    return bool(cfg.get("use_sliding_window", cfg.get("model_type") in ("mistral", "mixtral")))


def _moe_layers(cfg: _Fields, layers: int) -> int:
    """Qwen MoE: layers in `mlp_only_layers` or off the `decoder_sparse_step` grid are dense."""
    step = cfg.num("decoder_sparse_step", 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    return sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)


def _mixtral_or_qwen_moe(cfg: _Fields, name: str, source: str) -> ModelProfile:
    """Mixtral, Qwen2-MoE, Qwen3-MoE: full attention; routed experts (plus a Qwen2-MoE shared
    expert)."""
    layers = cfg.num("num_hidden_layers")
    attention = _attention(cfg)
    window = cfg.opt_num("sliding_window") if _uses_sliding_window(cfg) else None
    if cfg.get("num_local_experts") is not None:  # Mixtral: intermediate_size is per expert
        experts, expert_size, moe_layers = cfg.num("num_local_experts"), "intermediate_size", layers
    else:
        experts, expert_size = cfg.num("num_experts"), "moe_intermediate_size"
        moe_layers = _moe_layers(cfg, layers)
    moe = MoeDims(
        num_experts=experts,
        num_experts_per_tok=cfg.num("num_experts_per_tok"),
        moe_intermediate_size=cfg.num(expert_size),
        shared_intermediate_size=cfg.num("shared_expert_intermediate_size", 0),
    )
    return ModelProfile(
        **_common(cfg, name, source),
        groups=_groups(attention=attention, swa_window=window, has_full=window is None),
        num_full_layers=0 if window else layers,
        num_swa_layers=layers if window else 0,
        sliding_window=window,
        num_dense_mlp_layers=layers - moe_layers,
        num_moe_layers=moe_layers,
        attention=attention,
        intermediate_size=cfg.num("intermediate_size") if moe_layers < layers else 0,
        moe=moe,
    )


def _deepseek(cfg: _Fields, name: str, source: str) -> ModelProfile:
    """DeepSeek-V2/V3/R1: MLA in every layer; the first `first_k_dense_replace` MLPs dense, the
    rest routed experts plus `n_shared_experts` shared ones; MTP layers not counted."""
    layers = cfg.num("num_hidden_layers")
    dense = min(cfg.num("first_k_dense_replace", 0), layers)
    expert_size = cfg.num("moe_intermediate_size")
    mla = MlaDims(
        num_heads=cfg.num("num_attention_heads"),
        q_lora_rank=cfg.opt_num("q_lora_rank") or 0,
        kv_lora_rank=cfg.num("kv_lora_rank"),
        qk_nope_head_dim=cfg.num("qk_nope_head_dim"),
        qk_rope_head_dim=cfg.num("qk_rope_head_dim"),
        v_head_dim=cfg.num("v_head_dim"),
    )
    return ModelProfile(
        **_common(cfg, name, source),
        groups=_groups(attention=None, swa_window=None, has_full=True, mla=True),
        num_mla_layers=layers,
        num_dense_mlp_layers=dense,
        num_moe_layers=layers - dense,
        num_mtp_layers=cfg.num("num_nextn_predict_layers", 0),
        mla=mla,
        intermediate_size=cfg.num("intermediate_size"),
        moe=MoeDims(
            num_experts=cfg.num("n_routed_experts"),
            num_experts_per_tok=cfg.num("num_experts_per_tok"),
            moe_intermediate_size=expert_size,
            shared_intermediate_size=cfg.num("n_shared_experts", 0) * expert_size,
        ),
    )


def _gemma_layer_kinds(cfg: _Fields, layers: int) -> list[bool]:
    """True for a sliding-window layer. `layer_types` when given; else Gemma 3's
    `sliding_window_pattern` (every Nth layer global) or Gemma 2's alternation (even layers
    local)."""
    types = cfg.get("layer_types")
    if types:
        return [t == "sliding_attention" for t in types]
    if cfg.get("model_type") in ("gemma3", "gemma3_text"):
        pattern = cfg.num("sliding_window_pattern", 6)
        return [(i + 1) % pattern != 0 for i in range(layers)]
    return [i % 2 == 0 for i in range(layers)]


def _gemma(cfg: _Fields, name: str, source: str) -> ModelProfile:
    """Gemma 2 and Gemma 3: interleaved sliding-window and global layers, GeGLU MLP, tied
    embeddings."""
    layers = cfg.num("num_hidden_layers")
    swa = sum(_gemma_layer_kinds(cfg, layers))
    window = cfg.num("sliding_window")
    attention = _attention(cfg)
    return ModelProfile(
        **_common(cfg, name, source, tied=True),
        groups=_groups(attention=attention, swa_window=window, has_full=swa < layers),
        num_full_layers=layers - swa,
        num_swa_layers=swa,
        sliding_window=window,
        num_dense_mlp_layers=layers,
        attention=attention,
        intermediate_size=cfg.num("intermediate_size"),
    )


def _qwen_gdn(cfg: _Fields, name: str, source: str) -> ModelProfile:
    """Qwen3-Next and Qwen3.5: gated-delta-net layers with a gated full-attention layer every
    `full_attention_interval` (or as `layer_types` says); MoE (or a dense MLP for Qwen3.5
    dense); `mtp_num_hidden_layers` MTP layers."""
    layers = cfg.num("num_hidden_layers")
    types = cfg.get("layer_types")
    if types:
        full = sum(1 for t in types if t == "full_attention")
    else:
        interval = cfg.num("full_attention_interval", 4)
        full = sum(1 for i in range(layers) if (i + 1) % interval == 0)
    attention = _attention(cfg, output_gate=bool(cfg.get("attn_output_gate", True)))
    gdn = GdnDims(
        num_key_heads=cfg.num("linear_num_key_heads"),
        num_value_heads=cfg.num("linear_num_value_heads"),
        key_head_dim=cfg.num("linear_key_head_dim"),
        value_head_dim=cfg.num("linear_value_head_dim"),
        conv_kernel=cfg.num("linear_conv_kernel_dim"),
    )
    moe = None
    if cfg.get("num_experts"):
        moe = MoeDims(
            num_experts=cfg.num("num_experts"),
            num_experts_per_tok=cfg.num("num_experts_per_tok"),
            moe_intermediate_size=cfg.num("moe_intermediate_size"),
            shared_intermediate_size=cfg.num("shared_expert_intermediate_size", 0),
        )
    return ModelProfile(
        **_common(cfg, name, source),
        groups=_groups(attention=attention, swa_window=None, has_full=True, recurrent=gdn),
        num_full_layers=full,
        num_recurrent_layers=layers - full,
        num_dense_mlp_layers=0 if moe else layers,
        num_moe_layers=layers if moe else 0,
        num_mtp_layers=_mtp_layers(cfg),
        attention=attention,
        recurrent=gdn,
        intermediate_size=0 if moe else cfg.num("intermediate_size"),
        moe=moe,
    )


def _mtp_layers(cfg: _Fields) -> int:
    """Qwen3.5 states `mtp_num_hidden_layers`; Qwen3-Next's config.json has no such key and
    vLLM's Qwen3NextMTP defaults `num_nextn_predict_layers` to 1 (its checkpoint ships one)."""
    default = 1 if cfg.get("model_type") == "qwen3_next" else 0
    return cfg.num("mtp_num_hidden_layers", cfg.num("num_nextn_predict_layers", default))


def _mamba2(cfg: _Fields, prefix: str) -> Mamba2Dims:
    """Mamba2 dims: Nemotron-H names them `mamba_num_heads`/`ssm_state_size`/`n_groups`/
    `conv_kernel`; Bamba and Granite-hybrid `mamba_n_heads`/`mamba_d_state`/... ."""
    if prefix == "nemotron":
        return Mamba2Dims(
            num_heads=cfg.num("mamba_num_heads"),
            head_dim=cfg.num("mamba_head_dim"),
            state_size=cfg.num("ssm_state_size"),
            n_groups=cfg.num("n_groups"),
            conv_kernel=cfg.num("conv_kernel"),
            chunk_size=cfg.num("chunk_size", 128),
        )
    return Mamba2Dims(
        num_heads=cfg.num("mamba_n_heads"),
        head_dim=cfg.num("mamba_d_head"),
        state_size=cfg.num("mamba_d_state"),
        n_groups=cfg.num("mamba_n_groups"),
        conv_kernel=cfg.num("mamba_d_conv"),
        chunk_size=cfg.num("mamba_chunk_size", 256),
    )


def _nemotron_h(cfg: _Fields, name: str, source: str) -> ModelProfile:
    """Nemotron-H (and Nemotron 3): `hybrid_override_pattern` gives one character per layer:
    M Mamba2, * attention, - relu2 MLP, E MoE (relu2 experts, counted as gated here)."""
    pattern = str(cfg.get("hybrid_override_pattern") or "")
    if not pattern:
        raise ConfigError("config.hybrid_override_pattern", None, "give the layer pattern")
    # Nemotron-H names the head size attention_head_dim; Nemotron 3 configs use head_dim.
    attention = _attention(
        cfg, head_dim_key="head_dim" if cfg.get("head_dim") else "attention_head_dim"
    )
    mamba = _mamba2(cfg, "nemotron")
    moe = None
    if "E" in pattern:
        moe = MoeDims(
            num_experts=cfg.num("n_routed_experts"),
            num_experts_per_tok=cfg.num("num_experts_per_tok"),
            moe_intermediate_size=cfg.num("moe_intermediate_size"),
            shared_intermediate_size=cfg.num("moe_shared_expert_intermediate_size", 0),
        )
    return ModelProfile(
        **_common(cfg, name, source),
        groups=_groups(attention=attention, swa_window=None, has_full=True, recurrent=mamba),
        num_full_layers=pattern.count("*"),
        num_recurrent_layers=pattern.count("M"),
        num_dense_mlp_layers=pattern.count("-"),
        num_moe_layers=pattern.count("E"),
        attention=attention,
        recurrent=mamba,
        intermediate_size=cfg.num("intermediate_size", 0),
        mlp_gated=False,
        moe=moe,
    )


def _bamba_or_granite(cfg: _Fields, name: str, source: str) -> ModelProfile:
    """Bamba (`attn_layer_indices`) and Granite-4.0-hybrid (`layer_types` mamba/attention):
    every layer has a SwiGLU MLP (Granite: routed experts plus the shared MLP, or the shared
    MLP alone when `num_local_experts` is 0)."""
    layers = cfg.num("num_hidden_layers")
    if cfg.get("layer_types"):
        full = sum(1 for t in cfg.get("layer_types") if t == "attention")
    else:
        full = len(cfg.get("attn_layer_indices") or [])
    attention = _attention(cfg)
    mamba = _mamba2(cfg, "bamba")
    experts = cfg.num("num_local_experts", 0)
    # Granite without experts runs its shared MLP alone; Bamba's MLP is intermediate_size.
    dense_key = "shared_intermediate_size" if cfg.get("shared_intermediate_size") else None
    moe = None
    if experts:
        moe = MoeDims(
            num_experts=experts,
            num_experts_per_tok=cfg.num("num_experts_per_tok"),
            moe_intermediate_size=cfg.num("intermediate_size"),
            shared_intermediate_size=cfg.num("shared_intermediate_size", 0),
        )
    return ModelProfile(
        **_common(cfg, name, source),
        groups=_groups(attention=attention, swa_window=None, has_full=True, recurrent=mamba),
        num_full_layers=full,
        num_recurrent_layers=layers - full,
        num_dense_mlp_layers=0 if moe else layers,
        num_moe_layers=layers if moe else 0,
        attention=attention,
        recurrent=mamba,
        intermediate_size=0 if moe else cfg.num(dense_key or "intermediate_size"),
        moe=moe,
    )


_Family = Callable[[_Fields, str, str], ModelProfile]
_FAMILIES: dict[str, _Family] = {
    "llama": _dense,
    "mistral": _dense,
    "qwen2": _dense,
    "qwen3": _dense,
    "mixtral": _mixtral_or_qwen_moe,
    "qwen2_moe": _mixtral_or_qwen_moe,
    "qwen3_moe": _mixtral_or_qwen_moe,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "gemma2": _gemma,
    "gemma3": _gemma,
    "gemma3_text": _gemma,
    "qwen3_next": _qwen_gdn,
    "qwen3_5": _qwen_gdn,
    "qwen3_5_text": _qwen_gdn,
    "qwen3_5_moe": _qwen_gdn,
    "qwen3_5_moe_text": _qwen_gdn,
    "nemotron_h": _nemotron_h,
    "bamba": _bamba_or_granite,
    "granitemoehybrid": _bamba_or_granite,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))
