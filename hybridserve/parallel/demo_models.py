"""Tiny random-weight decoders to check DCP end to end: a GQA Llama-style one and a sparse MLA one.

Each runs two ways: `forward_paged` over this rank's paged KV shard through the DCP attention
functions (what the executor will do), and `forward_dense` over a whole sequence with ordinary
unsharded causal attention (the reference).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hybridserve.core.errors import ConfigError
from hybridserve.parallel.group import DcpGroup
from hybridserve.parallel.layer import AttentionRows, dcp_attention
from hybridserve.parallel.mla import (
    MlaCaches,
    MlaConfig,
    MlaWeights,
    mla_attention,
    mla_attention_dense,
)
from hybridserve.parallel.rope import apply_rope, rms_norm

__all__ = ["TINY_MODELS", "GqaCaches", "TinyDecoder", "TinyModelConfig"]


@dataclass(frozen=True)
class TinyModelConfig:
    """A few-layer decoder; `attention` is `"gqa"` or `"mla"` (sparse when `mla.index_top_k`)."""

    attention: str = "gqa"
    vocab_size: int = 61
    hidden_size: int = 32
    num_layers: int = 2
    intermediate_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    mla: MlaConfig = field(default_factory=MlaConfig)

    def __post_init__(self) -> None:
        if self.attention not in ("gqa", "mla"):
            raise ConfigError("attention", self.attention, 'use "gqa" or "mla"')
        if self.mla.hidden_size != self.hidden_size:
            raise ConfigError("mla.hidden_size", self.mla.hidden_size, "match hidden_size")


@dataclass(frozen=True)
class GqaCaches:
    """One rank's paged K and V caches for one GQA layer."""

    k: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor


@dataclass(frozen=True)
class _Layer:
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    gqa: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None  # wq, wk, wv, wo
    mla: MlaWeights | None


Attend = Callable[[int, _Layer, torch.Tensor], torch.Tensor]


class TinyDecoder:
    """Random weights from `seed`; the same seed gives the same model on every rank."""

    def __init__(self, cfg: TinyModelConfig, *, seed: int, dtype: torch.dtype = torch.float64):
        self.cfg = cfg
        self.dtype = dtype
        gen = torch.Generator().manual_seed(seed)

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

        def linear(out_dim: int, in_dim: int) -> torch.Tensor:
            return rand(out_dim, in_dim, scale=in_dim**-0.5)

        def norm(dim: int) -> torch.Tensor:
            return 1.0 + rand(dim, scale=0.1)

        hidden, q_dim = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        kv_dim = cfg.num_kv_heads * cfg.head_dim
        self.embed = rand(cfg.vocab_size, hidden)
        self.layers = [
            _Layer(
                attn_norm=norm(hidden),
                mlp_norm=norm(hidden),
                w_gate=linear(cfg.intermediate_size, hidden),
                w_up=linear(cfg.intermediate_size, hidden),
                w_down=linear(hidden, cfg.intermediate_size),
                gqa=(
                    linear(q_dim, hidden),
                    linear(kv_dim, hidden),
                    linear(kv_dim, hidden),
                    linear(hidden, q_dim),
                )
                if cfg.attention == "gqa"
                else None,
                mla=MlaWeights.random(cfg.mla, gen, dtype) if cfg.attention == "mla" else None,
            )
            for _ in range(cfg.num_layers)
        ]
        self.final_norm = norm(hidden)
        self.lm_head = linear(cfg.vocab_size, hidden)

    def new_caches(self, *, num_blocks: int, block_size: int) -> list[GqaCaches | MlaCaches]:
        """Zeroed per-layer caches for one rank."""
        cfg = self.cfg
        if cfg.attention == "mla":
            return [
                MlaCaches.empty(
                    cfg.mla, num_blocks=num_blocks, block_size=block_size, dtype=self.dtype
                )
                for _ in range(cfg.num_layers)
            ]
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        return [
            GqaCaches(torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
            for _ in range(cfg.num_layers)
        ]

    def _qkv(
        self, layer: _Layer, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries and keys, values, and the output projection of a GQA layer."""
        if layer.gqa is None:
            raise ConfigError("attention", self.cfg.attention, "this layer has no GQA weights")
        wq, wk, wv, wo = layer.gqa
        rows, d = h.shape[0], self.cfg.head_dim
        q = apply_rope((h @ wq.T).view(rows, -1, d), positions)
        k = apply_rope((h @ wk.T).view(rows, -1, d), positions)
        return q, k, (h @ wv.T).view(rows, -1, d), wo

    def _run(self, token_ids: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = self.embed[token_ids]
        for index, layer in enumerate(self.layers):
            x = x + attend(index, layer, rms_norm(x, layer.attn_norm))
            h = rms_norm(x, layer.mlp_norm)
            x = (
                x
                + (torch.nn.functional.silu(h @ layer.w_gate.T) * (h @ layer.w_up.T))
                @ layer.w_down.T
            )
        return rms_norm(x, self.final_norm) @ self.lm_head.T

    def forward_paged(
        self,
        token_ids: torch.Tensor,
        *,
        rows: AttentionRows,
        caches: list[GqaCaches | MlaCaches],
        dcp: DcpGroup,
    ) -> torch.Tensor:
        """Logits `[rows, vocab]` for one step's rows; writes their KV into this rank's caches."""
        scale = self.cfg.head_dim**-0.5

        def attend(index: int, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
            cache = caches[index]
            if isinstance(cache, MlaCaches) and layer.mla is not None:
                return mla_attention(layer.mla, self.cfg.mla, h, rows=rows, caches=cache, dcp=dcp)
            if not isinstance(cache, GqaCaches):
                raise TypeError(f"layer {index}: cache {type(cache).__name__} does not fit")
            q, k, v, wo = self._qkv(layer, h, rows.positions)
            out = dcp_attention(
                q, k, v, k_cache=cache.k, v_cache=cache.v, rows=rows, dcp=dcp, scale=scale
            )
            return out.flatten(1) @ wo.T

        return self._run(token_ids, attend)

    def forward_dense(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Reference logits `[tokens, vocab]` of one whole sequence, no cache, no sharding."""
        positions = torch.arange(token_ids.shape[0])
        causal = torch.ones(len(positions), len(positions), dtype=torch.bool).tril()

        def attend(index: int, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
            if layer.mla is not None:
                return mla_attention_dense(layer.mla, self.cfg.mla, h)
            q, k, v, wo = self._qkv(layer, h, positions)
            group = self.cfg.num_heads // self.cfg.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.einsum("shd,thd->hst", q, k) * self.cfg.head_dim**-0.5
            probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            out = torch.einsum("hst,thd->shd", probs, v).flatten(1)
            return out @ wo.T

        return self._run(token_ids, attend)


TINY_MODELS = {
    "gqa": TinyModelConfig(),
    "mla": TinyModelConfig(attention="mla"),
    "sparse-mla": TinyModelConfig(attention="mla", mla=MlaConfig(index_top_k=5)),
}
