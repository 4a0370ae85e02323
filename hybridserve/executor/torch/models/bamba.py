"""Bamba: Mamba2 layers with a few full-attention layers (`attn_layer_indices`), gated MLPs.

Attention layers apply rotary to the first half of the head dim (Bamba's fixed partial rotary
factor when the config gives none).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from hybridserve.executor.torch.layers.mlp import GatedMLP
from hybridserve.executor.torch.layers.norm import RMSNorm
from hybridserve.executor.torch.layers.packed import project_qkv
from hybridserve.executor.torch.layers.rotary import Rotary
from hybridserve.executor.torch.models.base import (
    AttentionCache,
    DecoderOnlyLM,
    LayerCache,
    StateCache,
    register_model,
)
from hybridserve.executor.torch.models.qwen3_next import rotary_settings

if TYPE_CHECKING:
    from hybridserve.executor.torch.forward import ForwardContext

BAMBA_PARTIAL_ROTARY_FACTOR = 0.5


def attention_layers(config: dict[str, Any]) -> set[int]:
    num_layers = int(config["num_hidden_layers"])
    indices = set(config.get("attn_layer_indices") or ())
    outside = sorted(i for i in indices if not 0 <= i < num_layers)
    if outside:
        raise ConfigError(
            "config.attn_layer_indices", outside, f"use layer indices in 0..{num_layers - 1}"
        )
    return indices


class BambaAttention(nn.Module):
    def __init__(self, config: dict[str, Any], layer_index: int) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        self.layer_index = layer_index
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config.get("num_key_value_heads") or self.num_heads)
        self.head_dim = int(config.get("head_dim") or hidden // self.num_heads)
        bias = bool(config.get("attention_bias", False))
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.rotary_dim, base, scaling = rotary_settings(
            config, self.head_dim, default_factor=BAMBA_PARTIAL_ROTARY_FACTOR
        )
        self.rotary = Rotary(self.rotary_dim, base, scaling)
        self.scale = self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        n, rd = x.shape[0], self.rotary_dim
        q, k, v = project_qkv(self, x)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q_rot, k_rot = self.rotary(positions, q[..., :rd], k[..., :rd])
        q = torch.cat([q_rot, q[..., rd:]], dim=-1)
        k = torch.cat([k_rot, k[..., rd:]], dim=-1)
        out = ctx.attention(self.layer_index, q, k, v, scale=self.scale)
        return self.o_proj(out.reshape(n, -1))


class BambaDecoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any], layer_index: int, *, attention: bool) -> None:
        super().__init__()
        hidden, eps = int(config["hidden_size"]), float(config.get("rms_norm_eps", 1e-6))
        self.attention = attention
        if attention:
            self.self_attn = BambaAttention(config, layer_index)
        else:
            self.mamba = Mamba2Mixer(Mamba2Dims.from_bamba_config(config), layer_index)
        self.feed_forward = GatedMLP(
            hidden,
            int(config["intermediate_size"]),
            config.get("hidden_act", "silu"),
            bias=bool(config.get("mlp_bias", False)),
        )
        self.input_layernorm = RMSNorm(hidden, eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        mixed = self.self_attn(h, positions, ctx) if self.attention else self.mamba(h, ctx)
        x = x + mixed
        return x + self.feed_forward(self.pre_ff_layernorm(x))


@register_model("BambaForCausalLM", model_types=("bamba",))
class BambaForCausalLM(DecoderOnlyLM):
    """Checkpoint tensors as transformers names them (`model.layers.N.mamba.in_proj.weight`,
    `model.layers.N.feed_forward.gate_proj.weight`, `model.final_layernorm.weight`, ...)."""

    final_norm_name = "final_layernorm"

    def build_layers(self, config: dict[str, Any]) -> Iterable[nn.Module]:
        attn = attention_layers(config)
        return (
            BambaDecoderLayer(config, i, attention=i in attn)
            for i in range(int(config["num_hidden_layers"]))
        )

    def decoder_layers(self) -> list[BambaDecoderLayer]:
        return [cast(BambaDecoderLayer, layer) for layer in self.model.layers]

    def layer_caches(self) -> list[LayerCache]:
        caches: list[LayerCache] = []
        for layer in self.decoder_layers():
            if layer.attention:
                caches.append(
                    AttentionCache(layer.self_attn.num_kv_heads, layer.self_attn.head_dim)
                )
            else:
                caches.append(StateCache(shapes=layer.mamba.state_shapes()))
        return caches
