"""DeepSeek-V3 (multi-head latent attention) and DeepSeek-V3.2 (MLA + DSA sparse indexer).

Every layer caches one latent row `[normed c_kv | rotated k_pe]` per token (plus the indexer key
for V3.2) and attends through `ForwardContext.latent_attention` in the absorbed form. The MLP is
dense for the first layers and the DeepSeek MoE (sigmoid router with group-limited top-k, routed
experts and shared experts) after that. Parameter names are the checkpoint names, experts
included (`mlp.experts.<e>.gate_proj.weight`, as transformers saves them).

RoPE is default or yarn (the released checkpoints' `rope_scaling`), computed as transformers
does: yarn frequencies, cos/sin times the attention factor, and the softmax scale times
`mscale(factor, mscale_all_dim) ** 2`. Other RoPE types raise ConfigError.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch.forward import LatentIndex
from hybridserve.executor.torch.layers.mlp import GatedMLP
from hybridserve.executor.torch.layers.norm import RMSNorm
from hybridserve.executor.torch.layers.rotary import Rotary, inverse_frequencies
from hybridserve.executor.torch.models.base import (
    DecoderOnlyLM,
    LatentCache,
    LayerCache,
    register_model,
)
from hybridserve.executor.torch.models.llama import rope_settings

if TYPE_CHECKING:
    from hybridserve.executor.torch.forward import ForwardContext

_LORA_NORM_EPS = 1e-6  # q_a_layernorm, kv_a_layernorm and the indexer's k_norm use no config eps


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True, slots=True)
class DeepseekRope:
    """RoPE of the `qk_rope_head_dim` dims: inverse frequencies, the factor on cos/sin and the
    factor on the softmax scale (both 1 without yarn)."""

    inv_freq: torch.Tensor
    attention_factor: float
    softmax_factor: float

    def rotary(self) -> Rotary:
        """A rotate-half `Rotary` with these frequencies and cos/sin factor."""
        rotary = Rotary(self.inv_freq.numel() * 2, 1.0)
        rotary.inv_freq = self.inv_freq.clone()
        rotary.attention_factor = self.attention_factor
        return rotary


def deepseek_rope(config: dict[str, Any]) -> DeepseekRope:
    """Default RoPE, or yarn as transformers computes it (`_compute_yarn_parameters` for the
    frequencies and cos/sin factor, `yarn_apply_mscale` for the softmax scale)."""
    dim = int(config["qk_rope_head_dim"])
    base, scaling = rope_settings(config)
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return DeepseekRope(inverse_frequencies(dim, base, None), 1.0, 1.0)
    if kind != "yarn":
        field = "config.rope_parameters" if config.get("rope_parameters") else "config.rope_scaling"
        raise ConfigError(f"{field}.rope_type", kind, "DeepSeek models support default or yarn")
    max_positions = int(config.get("max_position_embeddings", 4096))
    original = int(scaling.get("original_max_position_embeddings") or max_positions)
    factor = float(scaling.get("factor") or max_positions / original)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation
    softmax_factor = _mscale(factor, float(mscale_all_dim)) ** 2 if mscale_all_dim else 1.0
    return DeepseekRope(inv_freq, float(attention_factor), softmax_factor)


def rotate_interleaved(x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """RoPE on interleaved pairs `(x0, x1), (x2, x3), ...` of `x` `[T, heads, rope]` with the
    frequencies of `rotary`, returned in the de-interleaved layout transformers produces
    (rotated evens, then rotated odds)."""
    inv_freq = cast(torch.Tensor, rotary.inv_freq)
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    cos = (freqs.cos() * rotary.attention_factor).to(x.dtype)[:, None, :]
    sin = (freqs.sin() * rotary.attention_factor).to(x.dtype)[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DeepseekIndexer(nn.Module):
    """The V3.2 lightning indexer: per-token index queries, head weights and one index key.

    The score of key t for query s is `sum_h w_h relu(q_h . k_t) / sqrt(index_head_dim)` with
    `w = weights_proj(x) / sqrt(index_n_heads)`; `ForwardContext` computes the sum and keeps the
    `index_topk` best keys. RoPE (rotate-half, unlike the MLA's interleaved pairs) covers the
    first `qk_rope_head_dim` dims of q and k.
    """

    def __init__(self, config: dict[str, Any], rope: DeepseekRope) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        self.num_heads = int(config["index_n_heads"])
        self.head_dim = int(config["index_head_dim"])
        self.rope_dim = int(config["qk_rope_head_dim"])
        self.top_k = int(config["index_topk"])
        if self.head_dim < self.rope_dim:
            raise ConfigError(
                "config.index_head_dim",
                self.head_dim,
                f"use at least qk_rope_head_dim={self.rope_dim}",
            )
        q_lora_rank = int(config["q_lora_rank"])
        self.wq_b = nn.Linear(q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=_LORA_NORM_EPS)
        self.weights_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.rotary = rope.rotary()

    def forward(
        self, x: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor
    ) -> LatentIndex:
        n, r = x.shape[0], self.rope_dim
        q = self.wq_b(q_resid).view(n, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(x))[:, None, :]
        q_rot, k_rot = self.rotary(positions, q[..., :r], k[..., :r])
        q = torch.cat([q_rot, q[..., r:]], dim=-1)
        k = torch.cat([k_rot, k[..., r:]], dim=-1)[:, 0]
        weights = self.weights_proj(x).float() * self.num_heads**-0.5
        return LatentIndex(q=q, weights=weights, k=k, top_k=self.top_k)


class DeepseekAttention(nn.Module):
    """MLA: low-rank q (or a plain `q_proj`), one shared latent per token, absorbed attention."""

    def __init__(self, config: dict[str, Any], layer_index: int, *, sparse: bool) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        bias = bool(config.get("attention_bias", False))
        self.layer_index = layer_index
        self.num_heads = int(config["num_attention_heads"])
        self.nope_dim = int(config["qk_nope_head_dim"])
        self.rope_dim = int(config["qk_rope_head_dim"])
        self.v_dim = int(config["v_head_dim"])
        self.kv_lora_rank = int(config["kv_lora_rank"])
        q_lora_rank = config.get("q_lora_rank")
        qk_dim = self.nope_dim + self.rope_dim
        if q_lora_rank is None:
            if sparse:
                raise ConfigError(
                    "config.q_lora_rank", None, "DeepSeek-V3.2's indexer needs a q_lora_rank"
                )
            self.q_proj = nn.Linear(hidden, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, int(q_lora_rank), bias=bias)
            self.q_a_layernorm = RMSNorm(int(q_lora_rank), _LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(int(q_lora_rank), self.num_heads * qk_dim, bias=False)
        self.has_q_lora = q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        rope = deepseek_rope(config)
        # transformers' V3.2 always rotates interleaved pairs; V3 follows `rope_interleave`.
        self.interleaved = sparse or bool(config.get("rope_interleave", True))
        self.rotary = rope.rotary()
        self.indexer = DeepseekIndexer(config, rope) if sparse else None
        self.scale = qk_dim**-0.5 * rope.softmax_factor

    def _rope(
        self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.interleaved:
            return (
                rotate_interleaved(q_pe, positions, self.rotary),
                rotate_interleaved(k_pe, positions, self.rotary),
            )
        return self.rotary(positions, q_pe, k_pe)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        n = x.shape[0]
        if self.has_q_lora:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        else:
            q_resid, q = x, self.q_proj(x)
        q = q.view(n, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = torch.split(q, [self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = torch.split(
            self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.rope_dim], dim=-1
        )
        q_pe, k_pe = self._rope(positions, q_pe, k_pe[:, None, :])
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_pe[:, 0]], dim=-1)
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)
        index = None if self.indexer is None else self.indexer(x, q_resid, positions)
        out = ctx.latent_attention(
            self.layer_index,
            q_nope,
            q_pe,
            latent,
            w_uk=w_kv[:, : self.nope_dim],
            w_uv=w_kv[:, self.nope_dim :],
            scale=self.scale,
            index=index,
        )
        return self.o_proj(out.reshape(n, -1))


class DeepseekRouter(nn.Module):
    """Sigmoid scores; experts chosen by score + correction bias among the best groups."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.num_experts = int(config["n_routed_experts"])
        self.top_k = int(config["num_experts_per_tok"])
        self.num_groups = int(config.get("n_group") or 1)
        self.top_k_groups = int(config.get("topk_group") or 1)
        self.norm_topk_prob = bool(config.get("norm_topk_prob", True))
        self.routed_scaling_factor = float(config.get("routed_scaling_factor", 1.0))
        per_group = self.num_experts // self.num_groups
        if self.num_experts % self.num_groups or per_group < 2:
            raise ConfigError(
                "config.n_group",
                self.num_groups,
                f"use a divisor of n_routed_experts={self.num_experts} leaving >= 2 per group",
            )
        for name, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if config.get(name, want) != want:
                raise ConfigError(f"config.{name}", config[name], f"only {want!r} is supported")
        hidden = int(config["hidden_size"])
        self.weight = nn.Parameter(torch.zeros(self.num_experts, hidden, dtype=torch.float32))
        # A parameter rather than a buffer so that load_weights fills it from the checkpoint.
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(self.num_experts, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids and weights, both `[T, num_experts_per_tok]` (weights in float32)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        grouped = choice.view(x.shape[0], self.num_groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(self.top_k_groups, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, best_groups, True)
        choice = grouped.masked_fill(~group_mask[:, :, None], float("-inf")).flatten(1)
        expert_ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return expert_ids, weights * self.routed_scaling_factor


class DeepseekMoE(nn.Module):
    """Routed experts weighted by the router, plus the always-on shared experts."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, act = int(config["hidden_size"]), config.get("hidden_act", "silu")
        inner = int(config["moe_intermediate_size"])
        self.gate = DeepseekRouter(config)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, inner, act) for _ in range(self.gate.num_experts)
        )
        num_shared = int(config.get("n_shared_experts") or 0)
        self.shared_experts = GatedMLP(hidden, inner * num_shared, act) if num_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert_ids, weights = self.gate(x)
        out = torch.zeros_like(x)
        for expert in expert_ids.unique().tolist():
            rows, slot = torch.where(expert_ids == expert)
            y = self.experts[expert](x[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def is_moe_layer(config: dict[str, Any], layer_index: int) -> bool:
    """`mlp_layer_types[i] == "sparse"` when given (V3.2), else `i >= first_k_dense_replace`."""
    if not config.get("n_routed_experts"):
        return False
    types = config.get("mlp_layer_types")
    if types:
        return bool(types[layer_index] == "sparse")
    first_dense = config.get("first_k_dense_replace")
    return layer_index >= (3 if first_dense is None else int(first_dense))


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any], layer_index: int, *, sparse: bool) -> None:
        super().__init__()
        hidden, eps = int(config["hidden_size"]), float(config.get("rms_norm_eps", 1e-6))
        self.self_attn = DeepseekAttention(config, layer_index, sparse=sparse)
        self.mlp: nn.Module
        if is_moe_layer(config, layer_index):
            self.mlp = DeepseekMoE(config)
        else:
            self.mlp = GatedMLP(
                hidden, int(config["intermediate_size"]), config.get("hidden_act", "silu")
            )
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


@register_model("DeepseekV3ForCausalLM", model_types=("deepseek_v3",))
class DeepseekV3ForCausalLM(DecoderOnlyLM):
    """DeepSeek-V3. Multi-token-prediction layers in the checkpoint (`model.layers.<N>`, past
    `num_hidden_layers`) are not loaded."""

    sparse = False

    def build_layers(self, config: dict[str, Any]) -> Iterable[nn.Module]:
        return (
            DeepseekDecoderLayer(config, i, sparse=self.sparse)
            for i in range(config["num_hidden_layers"])
        )

    def layer_caches(self) -> list[LayerCache]:
        config = self.config
        latent_dim = int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])
        index_dim = int(config["index_head_dim"]) if self.sparse else 0
        return [LatentCache(latent_dim, index_dim) for _ in self.model.layers]


@register_model("DeepseekV32ForCausalLM", model_types=("deepseek_v32",))
class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: every attention layer carries a DSA indexer (sparse top-k attention)."""

    sparse = True
