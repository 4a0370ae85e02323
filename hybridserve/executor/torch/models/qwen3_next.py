"""Qwen3-Next and Qwen3.5: gated delta net layers between gated full-attention layers.

Full attention: q/k RMS norms with `1 + w`, rotary on the first `partial_rotary_factor` of the
head dim, output multiplied by sigmoid of a gate projected with q. Linear attention: the gated
delta net (`layers/gated_delta.py`). MLPs are mixtures of experts with a gated shared expert
when the config has `num_experts` (Qwen3-Next, Qwen3.5-MoE), else gated MLPs (Qwen3.5 dense).
Qwen3.5 has unfused delta-net projections; its multimodal checkpoints serve text only here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch.layers.gated_delta import GatedDeltaNet
from hybridserve.executor.torch.layers.mlp import GatedMLP
from hybridserve.executor.torch.layers.norm import RMSNorm
from hybridserve.executor.torch.layers.rotary import Rotary
from hybridserve.executor.torch.models.base import (
    AttentionCache,
    DecoderOnlyLM,
    LayerCache,
    StateCache,
    register_model,
)

if TYPE_CHECKING:
    from hybridserve.executor.torch.forward import ForwardContext

LINEAR, FULL = "linear_attention", "full_attention"


def layer_types(config: dict[str, Any]) -> list[str]:
    """`layer_types`, or every `full_attention_interval`-th layer full (older config.json)."""
    num_layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        interval = int(config.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
    types = list(types)
    for i, kind in enumerate(types):
        if kind not in (LINEAR, FULL):
            raise ConfigError(f"config.layer_types[{i}]", kind, f"use {LINEAR!r} or {FULL!r}")
    if len(types) != num_layers:
        raise ConfigError(
            "config.layer_types", f"<{len(types)} entries>", f"give {num_layers} (one per layer)"
        )
    return types


def rotary_settings(
    config: dict[str, Any], head_dim: int, *, default_factor: float = 1.0
) -> tuple[int, float, dict[str, Any]]:
    """(rotary dim, base, scaling) from `rope_parameters` or the older top-level keys."""
    params = config.get("rope_parameters") or {}
    base = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    factor = default_factor if factor is None else float(factor)
    scaling = {k: v for k, v in params.items() if k not in ("mrope_section", "mrope_interleaved")}
    scaling.update(config.get("rope_scaling") or {})
    return int(head_dim * factor), base, scaling


class GatedAttention(nn.Module):
    def __init__(self, config: dict[str, Any], layer_index: int) -> None:
        super().__init__()
        hidden, eps = int(config["hidden_size"]), float(config.get("rms_norm_eps", 1e-6))
        self.layer_index = layer_index
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config.get("num_key_value_heads") or self.num_heads)
        self.head_dim = int(config.get("head_dim") or hidden // self.num_heads)
        bias = bool(config.get("attention_bias", False))
        self.q_proj = nn.Linear(hidden, 2 * self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps, offset=True)
        self.k_norm = RMSNorm(self.head_dim, eps, offset=True)
        self.rotary_dim, base, scaling = rotary_settings(config, self.head_dim)
        self.rotary = Rotary(self.rotary_dim, base, scaling)
        self.scale = self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        n, rd = x.shape[0], self.rotary_dim
        q, gate = self.q_proj(x).view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q_rot, k_rot = self.rotary(positions, q[..., :rd], k[..., :rd])
        q = torch.cat([q_rot, q[..., rd:]], dim=-1)
        k = torch.cat([k_rot, k[..., rd:]], dim=-1)
        out = ctx.attention(self.layer_index, q, k, v, scale=self.scale)
        out = out.reshape(n, -1) * torch.sigmoid(gate.reshape(n, -1))
        return self.o_proj(out)


class SparseMoe(nn.Module):
    """Top-k routed experts plus a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, act = int(config["hidden_size"]), config.get("hidden_act", "silu")
        self.top_k = int(config["num_experts_per_tok"])
        self.normalize = bool(config.get("norm_topk_prob", True))
        num_experts = int(config["num_experts"])
        if not 0 < self.top_k <= num_experts:
            raise ConfigError(
                "config.num_experts_per_tok", self.top_k, f"use 1..num_experts={num_experts}"
            )
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, int(config["moe_intermediate_size"]), act) for _ in range(num_experts)
        )
        self.shared_expert = GatedMLP(hidden, int(config["shared_expert_intermediate_size"]), act)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for expert_id in chosen.unique().tolist():
            rows, slot = torch.where(chosen == expert_id)
            expert_out = self.experts[expert_id](x[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, expert_out)
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def uses_experts(config: dict[str, Any], layer_index: int) -> bool:
    num_experts = int(config.get("num_experts") or 0)
    step = int(config.get("decoder_sparse_step") or 1)
    only_mlp = layer_index in (config.get("mlp_only_layers") or ())
    return num_experts > 0 and not only_mlp and (layer_index + 1) % step == 0


class DecoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any], layer_index: int, kind: str, *, qwen3_5: bool):
        super().__init__()
        hidden, eps = int(config["hidden_size"]), float(config.get("rms_norm_eps", 1e-6))
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(config, layer_index, fused_projections=not qwen3_5)
        else:
            self.self_attn = GatedAttention(config, layer_index)
        self.mlp: nn.Module
        if uses_experts(config, layer_index):
            self.mlp = SparseMoe(config)
        else:
            act = config.get("hidden_act", "silu")
            self.mlp = GatedMLP(hidden, int(config["intermediate_size"]), act)
        self.input_layernorm = RMSNorm(hidden, eps, offset=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=True)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.kind == LINEAR:
            x = x + self.linear_attn(h, ctx)
        else:
            x = x + self.self_attn(h, positions, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


def split_fused_experts(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert tensors from stacked ones (`experts.gate_up_proj` `[E, 2 * I, H]`,
    `experts.down_proj` `[E, H, I]`, the layout transformers holds in memory)."""
    for name, tensor in weights:
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            gate, up = tensor.chunk(2, dim=1)
            for expert in range(tensor.shape[0]):
                yield f"{prefix}{expert}.gate_proj.weight", gate[expert]
                yield f"{prefix}{expert}.up_proj.weight", up[expert]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for expert in range(tensor.shape[0]):
                yield f"{prefix}{expert}.down_proj.weight", tensor[expert]
        else:
            yield name, tensor


@register_model("Qwen3NextForCausalLM", model_types=("qwen3_next",))
class Qwen3NextForCausalLM(DecoderOnlyLM):
    """Qwen3-Next; checkpoint tensors are named as transformers saves them (`model.layers.N.
    linear_attn.in_proj_qkvz.weight`, `model.layers.N.mlp.experts.E.gate_proj.weight`, ...).
    The multi-token-prediction head (`mtp.*`) is not used."""

    final_norm_offset = True
    qwen3_5 = False

    def build_layers(self, config: dict[str, Any]) -> Iterable[nn.Module]:
        return (
            DecoderLayer(config, i, kind, qwen3_5=self.qwen3_5)
            for i, kind in enumerate(layer_types(config))
        )

    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.model.layers]

    def layer_caches(self) -> list[LayerCache]:
        caches: list[LayerCache] = []
        for layer in self.decoder_layers():
            if layer.kind == LINEAR:
                caches.append(StateCache(shapes=layer.linear_attn.state_shapes()))
            else:
                attn = layer.self_attn
                caches.append(AttentionCache(attn.num_kv_heads, attn.head_dim))
        return caches

    def checkpoint_renames(self, name: str) -> str | None:
        if name.startswith("mtp."):
            return None
        return super().checkpoint_renames(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_fused_experts(weights))


@register_model(
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    model_types=("qwen3_5_text", "qwen3_5_moe_text"),
)
class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 text model (dense or MoE): unfused delta-net projections. Text positions only,
    for which the multimodal rotary sections reduce to plain rotary."""

    qwen3_5 = True


@register_model(
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    model_types=("qwen3_5", "qwen3_5_moe"),
)
class Qwen3_5TextOfMultimodal(Qwen3_5ForCausalLM):
    """The language model of a Qwen3.5 image-text checkpoint, for text prompts: reads
    `text_config`, loads `model.language_model.*` and skips the vision tower (`model.visual.*`)."""

    def __init__(self, config: dict[str, Any], dtype: torch.dtype = torch.float32) -> None:
        if "hidden_size" not in config:
            text = config.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(
                    "config.text_config", text, "a Qwen3.5 multimodal config.json has a text_config"
                )
            config = {**config, **text}
        super().__init__(config, dtype)

    def checkpoint_renames(self, name: str) -> str | None:
        if name.startswith("model.visual."):
            return None
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        return super().checkpoint_renames(name)
