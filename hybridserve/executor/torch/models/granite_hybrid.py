"""Granite 4 hybrid (GraniteMoeHybrid): Mamba2 and attention layers, a shared MLP per layer plus
optional routed experts, and Granite's embedding, residual, attention and logits multipliers.

Attention uses rotary only when `position_embedding_type == "rope"` (Granite 4.0-H uses none).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch.layers.mamba2 import Mamba2Dims, Mamba2Mixer
from hybridserve.executor.torch.layers.mlp import activation, gated_product
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

_MAMBA = ("mamba", "linear_attention")
_ATTENTION = ("attention", "full_attention")


def attention_flags(config: dict[str, Any]) -> list[bool]:
    """Per layer, True for attention; `layer_types` in either spelling, default all Mamba."""
    num_layers = int(config["num_hidden_layers"])
    types = config.get("layer_types") or ["mamba"] * num_layers
    if len(types) != num_layers:
        raise ConfigError(
            "config.layer_types", f"<{len(types)} entries>", f"give {num_layers} (one per layer)"
        )
    for i, kind in enumerate(types):
        if kind not in _MAMBA + _ATTENTION:
            raise ConfigError(f"config.layer_types[{i}]", kind, f"use one of {_MAMBA + _ATTENTION}")
    return [kind in _ATTENTION for kind in types]


class GraniteAttention(nn.Module):
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
        kind = config.get("position_embedding_type")
        if kind not in (None, "nope", "rope"):
            raise ConfigError("config.position_embedding_type", kind, "use 'rope' or none")
        self.rotary: Rotary | None = None
        if kind == "rope":
            _, base, scaling = rotary_settings(config, self.head_dim)
            self.rotary = Rotary(self.head_dim, base, scaling)
        self.scale = float(config.get("attention_multiplier", 1.0))

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = project_qkv(self, x)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        out = ctx.attention(self.layer_index, q, k, v, scale=self.scale)
        return self.o_proj(out.reshape(n, -1))


class SharedMLP(nn.Module):
    """`output_linear(act(gate) * up)` with gate and up stacked in `input_linear`."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.output_linear = nn.Linear(intermediate, hidden, bias=False)
        self.act_name = act
        activation(act)  # a clear error for an unknown one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(gated_product(self.input_linear(x), self.act_name))


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden, num_experts, bias=False)


class GraniteMoe(nn.Module):
    """Top-k experts (softmax over the top-k router logits); expert weights stacked per tensor:
    `input_linear.weight` `[E, 2 * intermediate, hidden]`, `output_linear.weight`
    `[E, hidden, intermediate]`."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
        num_experts = int(config["num_local_experts"])
        self.top_k = int(config["num_experts_per_tok"])
        if not 0 < self.top_k <= num_experts:
            raise ConfigError(
                "config.num_experts_per_tok", self.top_k, f"use 1..num_local_experts={num_experts}"
            )
        self.router = Router(hidden, num_experts)
        self.input_linear = nn.Module()
        self.input_linear.weight = nn.Parameter(torch.zeros(num_experts, 2 * inter, hidden))
        self.output_linear = nn.Module()
        self.output_linear.weight = nn.Parameter(torch.zeros(num_experts, hidden, inter))
        self.act = activation(config.get("hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, chosen = self.router.layer(x).float().topk(self.top_k, dim=-1)
        weights = torch.softmax(logits, dim=-1).to(x.dtype)
        w_in, w_out = self.input_linear.weight, self.output_linear.weight
        out = torch.zeros_like(x)
        for expert_id in chosen.unique().tolist():
            rows, slot = torch.where(chosen == expert_id)
            gate, up = F.linear(x[rows], w_in[expert_id]).chunk(2, dim=-1)
            expert_out = F.linear(self.act(gate) * up, w_out[expert_id])
            out.index_add_(0, rows, expert_out * weights[rows, slot, None])
        return out


class GraniteHybridDecoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any], layer_index: int, *, attention: bool) -> None:
        super().__init__()
        hidden, eps = int(config["hidden_size"]), float(config.get("rms_norm_eps", 1e-6))
        self.attention = attention
        self.residual_multiplier = float(config.get("residual_multiplier", 1.0))
        if attention:
            self.self_attn = GraniteAttention(config, layer_index)
        else:
            self.mamba = Mamba2Mixer(Mamba2Dims.from_bamba_config(config), layer_index)
        self.block_sparse_moe = GraniteMoe(config) if config.get("num_local_experts") else None
        self.shared_mlp = SharedMLP(
            hidden, int(config["shared_intermediate_size"]), config.get("hidden_act", "silu")
        )
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        mixed = self.self_attn(h, positions, ctx) if self.attention else self.mamba(h, ctx)
        x = x + mixed * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        out = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            out = out + self.block_sparse_moe(h)
        return x + out * self.residual_multiplier


@register_model("GraniteMoeHybridForCausalLM", model_types=("granitemoehybrid",))
class GraniteMoeHybridForCausalLM(DecoderOnlyLM):
    """Checkpoint tensors as transformers names them (`model.layers.N.mamba.in_proj.weight`,
    `model.layers.N.shared_mlp.input_linear.weight`, `...block_sparse_moe.router.layer.weight`)."""

    def __init__(self, config: dict[str, Any], dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, dtype)
        self.embedding_multiplier = float(config.get("embedding_multiplier", 1.0))
        self.logits_scaling = float(config.get("logits_scaling", 1.0))

    def build_layers(self, config: dict[str, Any]) -> Iterable[nn.Module]:
        return (
            GraniteHybridDecoderLayer(config, i, attention=flag)
            for i, flag in enumerate(attention_flags(config))
        )

    def decoder_layers(self) -> list[GraniteHybridDecoderLayer]:
        return [cast(GraniteHybridDecoderLayer, layer) for layer in self.model.layers]

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

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.model.embed_tokens.weight) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lm_head(hidden) / self.logits_scaling).float()
