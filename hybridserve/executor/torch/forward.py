"""ForwardContext: a step's view of the paged KV and recurrent state, handed to the model.

Attention metadata is built once per cache group per step and shared by the group's layers.
A batch is the plan's chunks concatenated; attention runs as one padded SDPA call per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridserve.executor.torch.cache import DeviceCache


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
    ) -> None:
        self.cache = cache
        self.layer_group = layer_group
        self.attention_meta = attention
        self.states = states
        self.num_tokens = num_tokens
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
        meta = self.attention_meta[self.layer_group[layer_index]]
        k_cache, v_cache = self.cache.kv(layer_index)
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
