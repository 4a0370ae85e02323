"""Llama family (Llama 2/3, SmolLM2, Mistral without sliding window): full attention only."""

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


def rope_settings(config: dict[str, Any], default_base: float = 10000.0) -> tuple[float, Any]:
    """(base, scaling dict) from either `rope_theta`/`rope_scaling` or `rope_parameters`."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"]), params
    return float(config.get("rope_theta", default_base)), config.get("rope_scaling")


class LlamaAttention(nn.Module):
    def __init__(self, config: dict[str, Any], layer_index: int) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.layer_index = layer_index
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        bias = bool(config.get("attention_bias", False))
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        base, scaling = rope_settings(config)
        self.rotary = Rotary(self.head_dim, base, scaling)
        self.scale = self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = project_qkv(self, x)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = ctx.attention(self.layer_index, q, k, v, scale=self.scale)
        return self.o_proj(out.reshape(n, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any], layer_index: int) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(config, layer_index)
        self.mlp = GatedMLP(
            hidden,
            config["intermediate_size"],
            config.get("hidden_act", "silu"),
            bias=bool(config.get("mlp_bias", False)),
        )
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


@register_model("LlamaForCausalLM", "MistralForCausalLM", model_types=("llama", "mistral"))
class LlamaForCausalLM(DecoderOnlyLM):
    def __init__(self, config: dict[str, Any], dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, dtype)
        if config.get("sliding_window") and config.get("model_type") == "mistral":
            self.window: int | None = int(config["sliding_window"])
        else:
            self.window = None

    def build_layers(self, config: dict[str, Any]) -> Iterable[nn.Module]:
        return (LlamaDecoderLayer(config, i) for i in range(config["num_hidden_layers"]))

    def layer_caches(self) -> list[LayerCache]:
        attn = cast(LlamaAttention, self.model.layers[0].self_attn)
        spec = AttentionCache(int(attn.num_kv_heads), int(attn.head_dim), self.window)
        return [spec for _ in self.model.layers]
