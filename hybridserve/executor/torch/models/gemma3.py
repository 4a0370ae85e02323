"""Gemma 3 (text): interleaved sliding-window and full attention with per-layer-type RoPE bases,
q/k norms, sandwich norms around attention and MLP, scaled embeddings, optional softcapping."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from hybridserve.executor.torch.layers.mlp import GatedMLP
from hybridserve.executor.torch.layers.norm import RMSNorm
from hybridserve.executor.torch.layers.packed import project_qkv
from hybridserve.executor.torch.layers.rotary import Rotary
from hybridserve.executor.torch.models.base import (
    AttentionCache,
    DecoderOnlyLM,
    LayerCache,
    register_model,
)

if TYPE_CHECKING:
    from hybridserve.executor.torch.forward import ForwardContext

SLIDING = "sliding_attention"
FULL = "full_attention"


def layer_types(config: dict[str, Any]) -> list[str]:
    types = config.get("layer_types")
    if types:
        return list(types)
    pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern", 6))
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config["num_hidden_layers"])]


def rope_for(config: dict[str, Any], layer_type: str) -> tuple[float, dict[str, Any] | None]:
    params = config.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        entry = params[layer_type]
        return float(entry["rope_theta"]), entry
    if layer_type == SLIDING:
        return float(config.get("rope_local_base_freq", 10000.0)), None
    return float(config.get("rope_theta", 1_000_000.0)), config.get("rope_scaling")


class Gemma3Attention(nn.Module):
    def __init__(self, config: dict[str, Any], layer_index: int, layer_type: str) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.layer_index = layer_index
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        bias = bool(config.get("attention_bias", False))
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps, offset=True)
        self.k_norm = RMSNorm(self.head_dim, eps, offset=True)
        self.rotary = Rotary(self.head_dim, *rope_for(config, layer_type))
        self.scale = float(config.get("query_pre_attn_scalar") or self.head_dim) ** -0.5
        self.softcap = config.get("attn_logit_softcapping")
        self.window = int(config["sliding_window"]) if layer_type == SLIDING else None

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = project_qkv(self, x)
        q = self.q_norm(q.view(n, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = ctx.attention(self.layer_index, q, k, v, scale=self.scale, softcap=self.softcap)
        return self.o_proj(out.reshape(n, -1))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any], layer_index: int, layer_type: str) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.self_attn = Gemma3Attention(config, layer_index, layer_type)
        act = config.get("hidden_activation") or config.get("hidden_act", "gelu_pytorch_tanh")
        self.mlp = GatedMLP(hidden, config["intermediate_size"], act)
        self.input_layernorm = RMSNorm(hidden, eps, offset=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset=True)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset=True)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), positions, ctx)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp)


@register_model("Gemma3ForCausalLM", model_types=("gemma3_text",))
class Gemma3ForCausalLM(DecoderOnlyLM):
    final_norm_offset = True
    tie_embeddings_by_default = True

    def __init__(self, config: dict[str, Any], dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, dtype)
        self.embed_scale = float(config["hidden_size"]) ** 0.5
        self.final_softcap = config.get("final_logit_softcapping")

    def build_layers(self, config: dict[str, Any]) -> Iterable[nn.Module]:
        return (Gemma3DecoderLayer(config, i, kind) for i, kind in enumerate(layer_types(config)))

    def layer_caches(self) -> list[LayerCache]:
        caches: list[LayerCache] = []
        for layer in self.model.layers:
            attn = cast(Gemma3Attention, layer.self_attn)
            caches.append(AttentionCache(int(attn.num_kv_heads), int(attn.head_dim), attn.window))
        return caches

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight
        scale = torch.tensor(self.embed_scale, dtype=weight.dtype, device=weight.device)
        return self.model.embed_tokens(input_ids) * scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
