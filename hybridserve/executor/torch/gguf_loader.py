"""GGUF checkpoints: metadata to a Hugging Face style config, tensors dequantised to float and
renamed to transformers' names, so the same model classes load them.

llama.cpp stores llama q/k projections permuted for its interleaved RoPE; they are permuted
back here. Gemma norms are stored as `1 + w` (llama.cpp multiplies by the weight); the offset is
removed so that the Gemma `x * (1 + w)` norm applies.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch.gguf_file import GGUFFile
from hybridserve.executor.torch.loader import build_model
from hybridserve.executor.torch.models.base import CausalLM

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch not in ("llama", "gemma3"):
        raise ConfigError(
            "gguf general.architecture", arch, "use a llama or gemma3 GGUF (the supported ones)"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    config: dict[str, Any] = {
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 8192)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if arch == "llama":
        config.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu")
        if get("rope.dimension_count") is not None:
            config["head_dim"] = int(get("rope.dimension_count"))
    else:
        head_dim = int(get("attention.key_length", config["hidden_size"] // heads))
        config.update(
            architectures=["Gemma3ForCausalLM"],
            model_type="gemma3_text",
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=int(get("attention.sliding_window", 4096)),
            sliding_window_pattern=6,
            rope_local_base_freq=10000.0,
            hidden_activation="gelu_pytorch_tanh",
        )
    return config


def _unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved pairs back to rotate-half halves)."""
    half = weight.shape[0] // num_heads // 2
    permuted = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return permuted.swapaxes(1, 2).reshape(weight.shape)


def checkpoint_name(name: str, *, gemma: bool) -> str | None:
    """transformers' parameter name for a GGUF tensor name; None for tensors not used."""
    match = _BLOCK.match(name)
    if match is None:
        stem, _, kind = name.rpartition(".")
        return f"{_TOP_NAMES[stem]}.{kind}" if stem in _TOP_NAMES else None
    layer, part, kind = match.groups()
    if part == "ffn_norm":
        # llama's only MLP norm follows attention; gemma3's is the pre-feedforward one.
        target: str | None = "pre_feedforward_layernorm" if gemma else "post_attention_layernorm"
    else:
        target = _LAYER_NAMES.get(part)
    return f"model.layers.{layer}.{target}.{kind}" if target else None


def load_gguf_model(
    path: Path, *, dtype: torch.dtype = torch.float32, file: GGUFFile | None = None
) -> CausalLM:
    file = file or GGUFFile(path)
    tensors = {t.name: t for t in file.tensors}
    config = gguf_config(file.fields, set(tensors))
    if "token_embd.weight" not in tensors:
        raise ConfigError("model", str(path), "the GGUF has no token_embd.weight tensor")
    config.setdefault("vocab_size", tensors["token_embd.weight"].shape[0])
    gemma = config["model_type"] == "gemma3_text"
    model = build_model(config, dtype)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for tensor in file.tensors:
            name = checkpoint_name(tensor.name, gemma=gemma)
            if name is None:
                continue
            values = file.dequantized(tensor)
            if not gemma and part_is(tensor.name, "attn_q"):
                values = _unpermute_rope(values, config["num_attention_heads"])
            elif not gemma and part_is(tensor.name, "attn_k"):
                values = _unpermute_rope(values, config["num_key_value_heads"])
            if gemma and tensor.name.endswith("norm.weight"):
                values = values - 1.0
            yield name, torch.from_numpy(np.ascontiguousarray(values))

    model.load_weights(weights())
    return model


def part_is(name: str, part: str) -> bool:
    match = _BLOCK.match(name)
    return match is not None and match.group(2) == part
