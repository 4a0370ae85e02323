"""MLA attention (DeepSeek-V2/V3 latent KV) and its sparse variant (DeepSeek-V3.2 / GLM DSA).

The cache holds one latent row per token: `[c_kv | k_pe]` (`kv_lora_rank + qk_rope_head_dim`),
one "head". Queries absorb the key up-projection (`q_nope @ W_UK -> q_lat`), so attention is the
MQA form: every query head scores `[q_lat | q_pe] . [c_kv | k_pe]` and reads `c_kv` as the value;
the value up-projection `W_UV` is applied after the merge. The sparse variant scores every
earlier key with a small indexer and attends to the top-k only.

Under DCP (heads split across the group as under TP, KV split by token, no prefill context
parallelism) each rank computes its own heads' queries for **all** rows, prefill included,
all-gathers them to every head, attends over its latent shard, and merges with a reduce-scatter
back to its own heads (SPEC.md 4.4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridserve.parallel.attention import gather_local_tokens, partial_attention, write_owned_slots
from hybridserve.parallel.group import DcpGroup, all_gather_heads, merge_across_ranks
from hybridserve.parallel.layer import AttentionRows, local_keys
from hybridserve.parallel.rope import apply_rope, rms_norm
from hybridserve.parallel.sparse import index_scores, select_top_k

__all__ = ["MlaCaches", "MlaConfig", "MlaQueries", "MlaWeights", "mla_attention", "prepare_rows"]


@dataclass(frozen=True)
class MlaConfig:
    """A DeepSeek-V3-style MLA block; `index_top_k > 0` makes it sparse (DSA)."""

    hidden_size: int = 32
    num_heads: int = 4
    q_lora_rank: int = 16
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 8
    qk_rope_head_dim: int = 4
    v_head_dim: int = 8
    index_num_heads: int = 2
    index_head_dim: int = 8
    index_top_k: int = 0

    @property
    def scale(self) -> float:
        return float((self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MlaWeights:
    """Projection weights, `y = x @ w.T` as in `nn.Linear`."""

    wq_a: torch.Tensor  # [q_lora_rank, hidden]
    q_norm: torch.Tensor  # [q_lora_rank]
    wq_b: torch.Tensor  # [heads * (nope + rope), q_lora_rank]
    wkv_a: torch.Tensor  # [kv_lora_rank + rope, hidden]
    kv_norm: torch.Tensor  # [kv_lora_rank]
    wkv_b: torch.Tensor  # [heads * (nope + v), kv_lora_rank]: W_UK and W_UV per head
    wo: torch.Tensor  # [hidden, heads * v]
    index_wq: torch.Tensor  # [index_heads * index_dim, q_lora_rank]
    index_wk: torch.Tensor  # [index_dim, hidden]
    index_weights: torch.Tensor  # [index_heads, hidden]

    @classmethod
    def random(cls, cfg: MlaConfig, generator: torch.Generator, dtype: torch.dtype) -> MlaWeights:
        def linear(out_dim: int, in_dim: int) -> torch.Tensor:
            w = torch.randn(out_dim, in_dim, generator=generator, dtype=torch.float64)
            return (w / math.sqrt(in_dim)).to(dtype)

        def norm(dim: int) -> torch.Tensor:
            w = 1.0 + 0.1 * torch.randn(dim, generator=generator, dtype=torch.float64)
            return w.to(dtype)

        h, rope = cfg.num_heads, cfg.qk_rope_head_dim
        return cls(
            wq_a=linear(cfg.q_lora_rank, cfg.hidden_size),
            q_norm=norm(cfg.q_lora_rank),
            wq_b=linear(h * (cfg.qk_nope_head_dim + rope), cfg.q_lora_rank),
            wkv_a=linear(cfg.kv_lora_rank + rope, cfg.hidden_size),
            kv_norm=norm(cfg.kv_lora_rank),
            wkv_b=linear(h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            wo=linear(cfg.hidden_size, h * cfg.v_head_dim),
            index_wq=linear(cfg.index_num_heads * cfg.index_head_dim, cfg.q_lora_rank),
            index_wk=linear(cfg.index_head_dim, cfg.hidden_size),
            index_weights=linear(cfg.index_num_heads, cfg.hidden_size),
        )

    def up_projections(self, cfg: MlaConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """`W_UK` `[heads, nope, kv_lora]` and `W_UV` `[heads, v, kv_lora]`."""
        per_head = self.wkv_b.view(cfg.num_heads, -1, cfg.kv_lora_rank)
        return per_head[:, : cfg.qk_nope_head_dim], per_head[:, cfg.qk_nope_head_dim :]


@dataclass(frozen=True)
class MlaCaches:
    """One rank's paged caches for one MLA layer."""

    latent: torch.Tensor  # [num_blocks, block_size, 1, kv_lora_rank + rope]
    index_keys: torch.Tensor  # [num_blocks, block_size, 1, index_dim]

    @classmethod
    def empty(
        cls, cfg: MlaConfig, *, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> MlaCaches:
        shape = (num_blocks, block_size, 1)
        return cls(
            latent=torch.zeros(*shape, cfg.latent_dim, dtype=dtype),
            index_keys=torch.zeros(*shape, cfg.index_head_dim, dtype=dtype),
        )


@dataclass(frozen=True)
class MlaQueries:
    """The query side of every row, for this rank's heads."""

    q_nope: torch.Tensor  # [rows, local_heads, nope]
    q_pe: torch.Tensor  # [rows, local_heads, rope], rotated
    index_q: torch.Tensor  # [rows, index_heads, index_dim]
    index_weights: torch.Tensor  # [rows, index_heads]


def project_queries(
    w: MlaWeights, cfg: MlaConfig, x: torch.Tensor, positions: torch.Tensor, heads: slice
) -> MlaQueries:
    """Queries of every row for `heads`, and the indexer's queries and head weights."""
    q_latent = rms_norm(x @ w.wq_a.T, w.q_norm)
    q = (q_latent @ w.wq_b.T).view(x.shape[0], cfg.num_heads, -1)[:, heads]
    q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
    index_q = (q_latent @ w.index_wq.T).view(x.shape[0], cfg.index_num_heads, -1)
    index_weights = (x @ w.index_weights.T) * cfg.index_num_heads**-0.5
    return MlaQueries(q_nope, apply_rope(q_pe, positions), index_q, index_weights)


def project_latent(
    w: MlaWeights, cfg: MlaConfig, x: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's cache entries: latent `[c_kv | k_pe]` `[rows, 1, latent]`, index key."""
    kv = x @ w.wkv_a.T
    c_kv, k_pe = kv[:, : cfg.kv_lora_rank], kv[:, cfg.kv_lora_rank :]
    k_pe = apply_rope(k_pe.unsqueeze(1), positions)
    latent = torch.cat([rms_norm(c_kv, w.kv_norm).unsqueeze(1), k_pe], dim=-1)
    return latent, (x @ w.index_wk.T).unsqueeze(1)


def prepare_rows(
    w: MlaWeights,
    cfg: MlaConfig,
    x: torch.Tensor,
    *,
    positions: torch.Tensor,
    slots: torch.Tensor,
    caches: MlaCaches,
    heads: slice,
) -> MlaQueries:
    """Norm, rotate and cache one step's rows; returns the queries of **every** row.

    Mutates `caches` at the rows' non-negative slots only. A negative slot (another rank owns
    the token's KV) suppresses the latent and index-key writes and nothing else: that row's
    queries are still computed, because under DCP every rank attends for every row.
    """
    latent, index_key = project_latent(w, cfg, x, positions)
    write_owned_slots(caches.latent, latent, slots)
    write_owned_slots(caches.index_keys, index_key, slots)
    return project_queries(w, cfg, x, positions, heads)


def mla_attention(
    w: MlaWeights,
    cfg: MlaConfig,
    x: torch.Tensor,
    *,
    rows: AttentionRows,
    caches: MlaCaches,
    dcp: DcpGroup,
) -> torch.Tensor:
    """One MLA layer's attention output `[rows, hidden]` (before the residual), on every rank."""
    heads = dcp.head_slice(cfg.num_heads)
    queries = prepare_rows(
        w, cfg, x, positions=rows.positions, slots=rows.slots(dcp), caches=caches, heads=heads
    )
    w_uk, w_uv = w.up_projections(cfg)
    q_lat = torch.einsum("rhn,hnc->rhc", queries.q_nope, w_uk[heads])
    q_all = all_gather_heads(torch.cat([q_lat, queries.q_pe], dim=-1), dcp)
    window = local_keys(rows, dcp)
    latent = gather_local_tokens(caches.latent, rows.block_tables, window.mask.shape[1])
    mask = window.mask
    if cfg.index_top_k > 0:
        index_keys = gather_local_tokens(caches.index_keys, rows.block_tables, mask.shape[1])
        scores = index_scores(queries.index_q, queries.index_weights, index_keys[:, :, 0])
        mask = select_top_k(scores, mask, window.positions, k=cfg.index_top_k, dcp=dcp)
    values = latent[..., : cfg.kv_lora_rank]
    out_lat, lse = partial_attention(q_all, latent, values, mask, scale=cfg.scale)
    mine, _ = merge_across_ranks(out_lat, lse, mask.sum(dim=1), dcp, scatter_heads=True)
    out = torch.einsum("rhc,hvc->rhv", mine, w_uv[heads]).flatten(1)
    wo_cols = slice(heads.start * cfg.v_head_dim, heads.stop * cfg.v_head_dim)
    y = out @ w.wo[:, wo_cols].T
    if dcp.world_size > 1:
        torch.distributed.all_reduce(y, group=dcp.process_group)
    return y


def mla_attention_dense(w: MlaWeights, cfg: MlaConfig, x: torch.Tensor) -> torch.Tensor:
    """Reference: a whole sequence `[tokens, hidden]`, unsharded, unabsorbed, causal.

    Expands the latent to per-head keys and values and runs ordinary attention; the sparse
    variant keeps each query's top-k keys by index score (ties to the earlier key).
    """
    tokens = x.shape[0]
    positions = torch.arange(tokens, device=x.device)
    queries = project_queries(w, cfg, x, positions, slice(0, cfg.num_heads))
    latent, index_key = project_latent(w, cfg, x, positions)
    c_kv, k_pe = latent[:, 0, : cfg.kv_lora_rank], latent[:, 0, cfg.kv_lora_rank :]
    w_uk, w_uv = w.up_projections(cfg)
    k_nope = torch.einsum("tc,hnc->thn", c_kv, w_uk)
    v = torch.einsum("tc,hvc->thv", c_kv, w_uv)
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, cfg.num_heads, -1)], dim=-1)
    q = torch.cat([queries.q_nope, queries.q_pe], dim=-1)
    scores = torch.einsum("shd,thd->hst", q, k) * cfg.scale
    mask = torch.ones(tokens, tokens, dtype=torch.bool, device=x.device).tril()
    if cfg.index_top_k > 0:
        keys = index_key[:, 0].unsqueeze(0).expand(tokens, -1, -1)
        index = index_scores(queries.index_q, queries.index_weights, keys)
        mask = select_top_k(index, mask, positions, k=cfg.index_top_k, dcp=DcpGroup())
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.einsum("hst,thv->shv", probs, v).flatten(1)
    return out @ w.wo.T
