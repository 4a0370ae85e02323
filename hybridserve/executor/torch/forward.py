"""ForwardContext: a step's view of the paged KV and recurrent state, handed to the model.

Attention metadata is built once per cache group per step and shared by the group's layers.
A batch is the plan's chunks concatenated; attention runs as one padded SDPA call per layer.

Under decode context parallelism (a `DcpGroup` of N > 1 ranks) a full-attention or MLA group's
KV is sharded by token: one block id covers `block_size * N` tokens, `block_size` of them on each
rank. Such a group gets `AttentionRows` (every row's position and block table) instead of SDPA
metadata, and its layers attend with `hybridserve.parallel`: write the owned rows, attend over
the local shard, merge across the group by log-sum-exp. MLA groups always take that path (with
N = 1 it is plain absorbed MLA). Sliding-window and recurrent groups are replicated on every
rank and run as without DCP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridserve.executor.torch.cache import DeviceCache
from hybridserve.parallel.attention import partial_attention_chunks, write_owned_slots
from hybridserve.parallel.group import DcpGroup, all_gather_heads, merge_across_ranks
from hybridserve.parallel.layer import AttentionRows
from hybridserve.parallel.sharding import global_positions
from hybridserve.parallel.sparse import select_top_k


@dataclass(frozen=True, slots=True)
class AttentionMeta:
    """One attention group's gather/scatter indices for one step."""

    slot_mapping: torch.Tensor  # [T]: flat cache slot of each new token
    query_rows: torch.Tensor  # [B, Q]: row of the flat batch for each padded query
    query_valid: torch.Tensor  # [B, Q] bool
    key_slots: torch.Tensor  # [B, K]: flat cache slot for each padded key
    mask: torch.Tensor  # [B, 1, Q, K] bool: True where a query may attend a key


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """Where one request's chunk lies: rows of the flat batch and positions."""

    row_start: int
    num_tokens: int
    start: int  # position of the first token
    table: Sequence[int]  # the group's block table (mirrored by the executor)


@dataclass(frozen=True, slots=True)
class StateChunk:
    """One request's chunk as a recurrent layer sees it."""

    index: int  # chunk index in the step
    rows: slice  # rows of the flat batch
    read_slot: int | None  # state slot to start from; None = zero state
    snapshots: tuple[int, ...]  # save the state after this many tokens of the chunk (ascending)
    slots: tuple[tuple[int, ...], ...]  # per snapshot, the state slots receiving it


def build_attention_meta(
    spans: Sequence[ChunkSpan], *, block_size: int, window: int | None, device: torch.device
) -> AttentionMeta:
    """Gather indices for the chunks of one group (`window=None`: full attention)."""
    num_chunks = len(spans)
    max_q = max(s.num_tokens for s in spans)
    lows = [0 if window is None else max(0, s.start - window + 1) for s in spans]
    max_k = max(s.start + s.num_tokens - lo for s, lo in zip(spans, lows, strict=True))
    slot_mapping = []
    query_rows = torch.zeros(num_chunks, max_q, dtype=torch.long)
    query_valid = torch.zeros(num_chunks, max_q, dtype=torch.bool)
    key_slots = torch.zeros(num_chunks, max_k, dtype=torch.long)
    q_pos = torch.full((num_chunks, max_q), -1, dtype=torch.long)
    k_pos = torch.full((num_chunks, max_k), -1, dtype=torch.long)
    for b, (span, lo) in enumerate(zip(spans, lows, strict=True)):
        end = span.start + span.num_tokens
        table = torch.tensor(span.table, dtype=torch.long)
        new_pos = torch.arange(span.start, end)
        slot_mapping.append(table[new_pos // block_size] * block_size + new_pos % block_size)
        query_rows[b, : span.num_tokens] = torch.arange(
            span.row_start, span.row_start + span.num_tokens
        )
        query_valid[b, : span.num_tokens] = True
        q_pos[b, : span.num_tokens] = new_pos
        key_pos = torch.arange(lo, end)
        key_slots[b, : end - lo] = table[key_pos // block_size] * block_size + key_pos % block_size
        k_pos[b, : end - lo] = key_pos
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    mask = (kp <= qp) & (kp >= 0)
    if window is not None:
        mask &= kp > qp - window
    # A padded query row attends key 0 so that softmax stays finite; its output is dropped.
    mask[:, :, 0] |= ~query_valid
    return AttentionMeta(
        slot_mapping=torch.cat(slot_mapping).to(device),
        query_rows=query_rows.to(device),
        query_valid=query_valid.to(device),
        key_slots=key_slots.to(device),
        mask=mask[:, None].to(device),
    )


@dataclass(frozen=True, slots=True)
class ShardMeta:
    """One sharded (or MLA) group's step on this rank: where each row's K/V goes (if this rank
    owns it) and, per chunk, the local keys it attends to. Chunks are padded to `Q` queries and
    `K` local keys, as for SDPA; local key `j` of every sequence sits at the same position
    (`key_positions[j]`), in block `table[j // block_size]` at offset `j % block_size`."""

    slots: torch.Tensor  # [T]: this rank's flat cache slot of each row's token; -1 elsewhere
    query_rows: torch.Tensor  # [B, Q]: row of the flat batch for each padded query
    query_valid: torch.Tensor  # [B, Q] bool
    key_slots: torch.Tensor  # [B, K]: flat local slot of each chunk's local key
    key_positions: torch.Tensor  # [K]: sequence position of local key j
    mask: torch.Tensor  # [B, Q, K] bool: causal and within the chunk's local keys
    counts: torch.Tensor  # [T]: local keys each row attends to (rows in batch order)


def build_shard_meta(
    spans: Sequence[ChunkSpan], *, block_size: int, dcp: DcpGroup, device: torch.device
) -> ShardMeta:
    """The ShardMeta of one group's chunks on this rank of `dcp` (N = 1 for plain MLA)."""
    num_chunks = len(spans)
    max_q = max(s.num_tokens for s in spans)
    ends = torch.tensor([s.start + s.num_tokens for s in spans], dtype=torch.long)
    num_local = dcp.num_local_tokens(ends)
    max_k = int(num_local.max())
    index = torch.arange(max_k)
    key_positions = global_positions(
        index, rank=dcp.rank, world_size=dcp.world_size, interleave=dcp.interleave
    )
    width = max(len(s.table) for s in spans)
    positions, tables = [], []
    query_rows = torch.zeros(num_chunks, max_q, dtype=torch.long)
    query_valid = torch.zeros(num_chunks, max_q, dtype=torch.bool)
    q_pos = torch.full((num_chunks, max_q), -1, dtype=torch.long)
    key_slots = torch.zeros(num_chunks, max_k, dtype=torch.long)
    for b, span in enumerate(spans):
        table = torch.tensor(span.table, dtype=torch.long)
        new_pos = torch.arange(span.start, span.start + span.num_tokens)
        positions.append(new_pos)
        padded = torch.zeros(width, dtype=torch.long)
        padded[: len(table)] = table
        tables.append(padded.expand(span.num_tokens, -1))
        query_rows[b, : span.num_tokens] = torch.arange(
            span.row_start, span.row_start + span.num_tokens
        )
        query_valid[b, : span.num_tokens] = True
        q_pos[b, : span.num_tokens] = new_pos
        local = index[: int(num_local[b])]
        key_slots[b, : local.numel()] = table[local // block_size] * block_size + local % block_size
    mask = (key_positions[None, None, :] <= q_pos[:, :, None]) & (
        index[None, None, :] < num_local[:, None, None]
    )
    mask &= query_valid[:, :, None]
    rows = AttentionRows(torch.cat(positions), torch.cat(tables), block_size)
    return ShardMeta(
        slots=rows.slots(dcp).to(device),
        query_rows=query_rows.to(device),
        query_valid=query_valid.to(device),
        key_slots=key_slots.to(device),
        key_positions=key_positions.to(device),
        mask=mask.to(device),
        counts=mask[query_valid].sum(dim=-1).to(device),
    )


@dataclass(frozen=True, slots=True)
class LatentIndex:
    """The sparse-MLA indexer's inputs for the step's rows (DeepSeek-V3.2 DSA)."""

    q: torch.Tensor  # [T, index_heads, index_dim], rotated
    weights: torch.Tensor  # [T, index_heads], head weights (scale included)
    k: torch.Tensor  # [T, index_dim]: each new token's index key, to cache
    top_k: int


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`cache[slots]` for a [B, K] slot tensor: index_select copies whole rows, about 4x faster
    than advanced indexing on CPU (the gather dominates long-context decode there)."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


class ForwardContext:
    """Per step: attention metadata per group, state chunks per state group, and the cache."""

    def __init__(
        self,
        cache: DeviceCache,
        *,
        layer_group: Sequence[int],
        attention: dict[int, AttentionMeta],
        states: dict[int, list[StateChunk]],
        num_tokens: int,
        shards: dict[int, ShardMeta] | None = None,
        dcp: DcpGroup | None = None,
    ) -> None:
        self.cache = cache
        self.layer_group = layer_group
        self.attention_meta = attention
        self.states = states
        self.num_tokens = num_tokens
        self.shards = shards or {}  # sharded full-attention groups and MLA groups
        self.dcp = dcp or DcpGroup()
        self.aux_hidden: dict[int, torch.Tensor] = {}

    def attention(
        self,
        layer_index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Write k/v into the layer's paged cache, then attend. q `[T, H, D]`, k/v
        `[T, KVH, D]`; returns `[T, H, D]` (each token sees its request's earlier tokens)."""
        group = self.layer_group[layer_index]
        k_cache, v_cache = self.cache.kv(layer_index)
        shard = self.shards.get(group)
        if shard is not None:
            if softcap is not None:
                raise ValueError(
                    f"layer {layer_index}: attention logit soft-capping is not supported under "
                    "decode context parallelism; run this model with dcp=1"
                )
            write_owned_slots(k_cache[:, None], k, shard.slots)
            write_owned_slots(v_cache[:, None], v, shard.slots)
            kb = _gather(k_cache, shard.key_slots).to(q.dtype)  # [B, K, KVH, D]
            vb = _gather(v_cache, shard.key_slots).to(q.dtype)
            out, lse = partial_attention_chunks(
                q[shard.query_rows], kb, vb, shard.mask, scale=scale
            )
            valid = shard.query_valid
            merged, _ = merge_across_ranks(out[valid], lse[valid], shard.counts, self.dcp)
            return merged
        meta = self.attention_meta[group]
        k_cache[meta.slot_mapping] = k.to(k_cache.dtype)
        v_cache[meta.slot_mapping] = v.to(v_cache.dtype)
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        qb = q[meta.query_rows].transpose(1, 2)  # [B, H, Q, D]
        kb = _gather(k_cache, meta.key_slots).transpose(1, 2).to(q.dtype)  # [B, KVH, K, D]
        vb = _gather(v_cache, meta.key_slots).transpose(1, 2).to(q.dtype)
        if softcap is None:
            out = F.scaled_dot_product_attention(
                qb, kb, vb, attn_mask=meta.mask, scale=scale, enable_gqa=num_kv_heads != num_heads
            )
        else:
            if num_kv_heads != num_heads:
                kb = kb.repeat_interleave(num_heads // num_kv_heads, dim=1)
                vb = vb.repeat_interleave(num_heads // num_kv_heads, dim=1)
            scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale
            scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~meta.mask, float("-inf"))
            out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(vb.dtype), vb)
        out = out.transpose(1, 2)  # [B, Q, H, D]
        result = q.new_empty(q.shape)
        result[meta.query_rows[meta.query_valid]] = out[meta.query_valid]
        return result

    def latent_attention(
        self,
        layer_index: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        *,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        scale: float,
        index: LatentIndex | None = None,
    ) -> torch.Tensor:
        """MLA in the absorbed (MQA) form. `q_nope` `[T, H, nope]`, `q_pe` `[T, H, rope]`
        (rotated), `latent` `[T, kv_lora + rope]` (normed `c_kv`, rotated `k_pe`), `w_uk`
        `[H, nope, kv_lora]`, `w_uv` `[H, v, kv_lora]`. Caches each new token's latent row (and
        index key), attends every row over its request's earlier tokens (the indexer's top-k of
        them when `index` is given) and returns `[T, H, v]`, identical on every rank.

        Under DCP the heads are split across the group as under tensor parallelism: each rank
        absorbs its own heads' queries for **all** rows (prefill included), all-gathers them,
        attends over its latent shard, reduce-scatters the merge back to its heads, applies
        `w_uv` and all-gathers the heads. A row whose slot is negative (another rank owns its
        token's KV) skips only the cache writes.
        """
        shard = self.shards[self.layer_group[layer_index]]
        dcp = self.dcp
        latent_cache, index_cache = self.cache.kv(layer_index)
        write_owned_slots(latent_cache[:, None], latent.unsqueeze(1), shard.slots)
        if index is not None:
            write_owned_slots(index_cache[:, None], index.k.unsqueeze(1), shard.slots)
        heads = dcp.head_slice(q_nope.shape[1])
        kv_lora = w_uk.shape[-1]
        q_lat = torch.einsum("rhn,hnc->rhc", q_nope[:, heads], w_uk[heads])
        q_all = all_gather_heads(torch.cat([q_lat, q_pe[:, heads]], dim=-1), dcp)
        keys = _gather(latent_cache, shard.key_slots).to(q_all.dtype)  # [B, K, 1, latent]
        mask, valid = shard.mask, shard.query_valid
        if index is not None:
            index_keys = _gather(index_cache, shard.key_slots)[:, :, 0].to(index.q.dtype)
            logits = torch.einsum("bqhd,bkd->bqhk", index.q[shard.query_rows], index_keys)
            logits = torch.relu(logits * index.q.shape[-1] ** -0.5)
            scores = torch.einsum("bqhk,bqh->bqk", logits, index.weights[shard.query_rows])
            chosen = select_top_k(
                scores[valid], mask[valid], shard.key_positions, k=index.top_k, dcp=dcp
            )
            mask = torch.zeros_like(mask)
            mask[valid] = chosen
        # The value is the latent's c_kv part: attend with the whole latent and keep that part.
        out, lse = partial_attention_chunks(q_all[shard.query_rows], keys, keys, mask, scale=scale)
        out = out[..., :kv_lora]
        counts = mask[valid].sum(dim=-1)
        mine, _ = merge_across_ranks(out[valid], lse[valid], counts, dcp, scatter_heads=True)
        out_heads = torch.einsum("rhc,hvc->rhv", mine, w_uv[heads])
        return all_gather_heads(out_heads, dcp)

    def state_chunks(self, layer_index: int) -> list[StateChunk]:
        """The chunks a recurrent layer processes this step, in flat-batch order."""
        return self.states[self.layer_group[layer_index]]

    def load_state(self, layer_index: int, chunk: StateChunk) -> dict[str, torch.Tensor]:
        """The state the chunk starts from (a copy): the restored snapshot, or zeros."""
        return self.cache.read_state(layer_index, chunk.read_slot)

    def save_state(
        self, layer_index: int, chunk: StateChunk, num_tokens: int, state: dict[str, torch.Tensor]
    ) -> None:
        """Store the state after `num_tokens` tokens of `chunk` (one of `chunk.snapshots`)."""
        try:
            slots = chunk.slots[chunk.snapshots.index(num_tokens)]
        except ValueError:
            raise ValueError(
                f"layer {layer_index}: no snapshot requested after {num_tokens} tokens; "
                f"requested {chunk.snapshots}"
            ) from None
        for slot in slots:
            self.cache.write_state(layer_index, slot, state)
