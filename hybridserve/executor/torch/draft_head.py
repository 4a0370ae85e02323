"""An MTP/EAGLE-style draft head: one decoder layer fed with the target's hidden state at
position p and the embedding of the token at p + 1; its output predicts the token at p + 2.

The head's K/V lives in the target's full-attention group (one more layer there). Its K/V at
position p depends on the token at p + 1, which a plain prefix hit does not cover: EAGLE-style
methods either hash each block with the token after it (vLLM 0.33's lookahead block hashes, the
default) or drop the last block of a hit (`eagle-legacy`, `mtp-legacy`).
The executor checks it: every head K/V slot remembers the next token it was computed with, and a
resumed request whose head K/V at `start - 1` was computed for another token is refused
(`MissingDraftState`) rather than drafted from a guess.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybridserve.core.errors import HybridServeError
from hybridserve.core.plan import ScheduledChunk
from hybridserve.executor.torch.cache import DeviceCache
from hybridserve.executor.torch.forward import ChunkSpan, ForwardContext, build_attention_meta
from hybridserve.executor.torch.layers.norm import RMSNorm
from hybridserve.executor.torch.models.base import AttentionCache, CausalLM
from hybridserve.executor.torch.models.llama import LlamaDecoderLayer
from hybridserve.executor.torch.sampler import greedy_tokens


class MissingDraftState(HybridServeError):
    """A drafting request resumed where the head's state for the previous position is gone."""


class DraftHead(nn.Module):
    """fc([embed(next token), hidden]) -> one Llama decoder layer -> norm."""

    def __init__(self, target: CausalLM, layer_index: int, *, seed: int = 0) -> None:
        super().__init__()
        config = dict(target.config)
        config.setdefault("num_key_value_heads", config["num_attention_heads"])
        hidden = target.hidden_size
        generator = torch.Generator().manual_seed(seed)
        self.layer_index = layer_index
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer({**config, "hidden_act": "silu"}, layer_index)
        self.norm = RMSNorm(hidden, float(config.get("rms_norm_eps", 1e-6)))
        with torch.no_grad():
            for param in self.parameters():
                if param.dim() > 1:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)

    def cache_spec(self) -> AttentionCache:
        attn = self.layer.self_attn
        return AttentionCache(int(attn.num_kv_heads), int(attn.head_dim))

    def forward(  # type: ignore[override]
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        x = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))
        return self.norm(self.layer(x, positions, ctx))


@dataclass(slots=True)
class _HeadInput:
    req_id: str
    table: Sequence[int]
    positions: list[int]
    hidden: list[torch.Tensor]
    next_tokens: list[int]
    drafts: bool  # the request samples this step: draft after catching up


class DraftHeadRunner:
    """Runs the head after each target step: catches its K/V up, then drafts k tokens."""

    def __init__(
        self,
        head: DraftHead,
        target: CausalLM,
        cache: DeviceCache,
        *,
        group_id: int,
        layer_group: Sequence[int],
        num_tokens: int,
        block_size: int,
    ) -> None:
        self.head = head
        self.target = target
        self.cache = cache
        self.group_id = group_id
        self.layer_group = layer_group
        self.num_tokens = num_tokens
        self.block_size = block_size
        self.device = cache.kv(head.layer_index)[0].device
        # The next token each head K/V slot was computed with (-1: never computed).
        self.next_token = torch.full((cache.num_blocks * block_size,), -1, dtype=torch.long)
        self.pending: dict[str, torch.Tensor] = {}  # req_id -> hidden at start - 1

    def forget(self, req_id: str) -> None:
        self.pending.pop(req_id, None)

    def copy_block(self, src: int, dst: int, num_tokens: int) -> None:
        bs = self.block_size
        self.next_token[dst * bs : dst * bs + num_tokens] = self.next_token[
            src * bs : src * bs + num_tokens
        ].clone()

    def _slot(self, table: Sequence[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def check_resume(self, chunk: ScheduledChunk, table: Sequence[int]) -> None:
        """Refuse a request that resumes at `start` without valid head state at start - 1."""
        if chunk.start == 0:
            return
        recorded = int(self.next_token[self._slot(table, chunk.start - 1)])
        if recorded != chunk.token_ids[0]:
            raise MissingDraftState(
                f"request {chunk.req_id!r} resumes at position {chunk.start} with a draft head, "
                f"but the head's state for position {chunk.start - 1} was computed for another "
                "next token and the target hidden state that would recompute it is gone; use "
                "eagle, eagle3 or mtp, whose prefix hits either cover the next token (lookahead "
                "block hashes) or recompute the last block (the -legacy forms)"
            )

    def step(
        self,
        chunks: Sequence[ScheduledChunk],
        hidden: torch.Tensor,
        emitted: dict[str, tuple[int, ...]],
        tables: Mapping[str, Sequence[int]],
    ) -> dict[str, tuple[int, ...]]:
        inputs = []
        row = 0
        for chunk in chunks:
            inputs.append(self._catch_up(chunk, hidden, row, emitted.get(chunk.req_id), tables))
            row += chunk.num_tokens
        inputs = [i for i in inputs if i.positions]
        if not inputs:
            return {}
        outputs = self._run(inputs)
        drafting = [(i, out[-1]) for i, out in zip(inputs, outputs, strict=True) if i.drafts]
        return self._draft(drafting)

    def _catch_up(
        self,
        chunk: ScheduledChunk,
        hidden: torch.Tensor,
        row: int,
        emitted: tuple[int, ...] | None,
        tables: Mapping[str, Sequence[int]],
    ) -> _HeadInput:
        verified = chunk.num_tokens - chunk.num_draft_tokens
        if emitted is not None:
            known = [*chunk.token_ids[: verified + len(emitted) - 1], emitted[-1]]
        else:
            known = list(chunk.token_ids)
        last = chunk.start + len(known) - 2  # the last position whose next token is known
        previous = self.pending.pop(chunk.req_id, None)
        positions, states, nexts = [], [], []
        if previous is not None:
            positions.append(chunk.start - 1)
            states.append(previous)
            nexts.append(known[0])
        for p in range(chunk.start, last + 1):
            positions.append(p)
            states.append(hidden[row + p - chunk.start])
            nexts.append(known[p - chunk.start + 1])
        if emitted is None:
            self.pending[chunk.req_id] = hidden[row + chunk.num_tokens - 1]
        return _HeadInput(
            chunk.req_id, tables[chunk.req_id], positions, states, nexts, emitted is not None
        )

    def _run(self, inputs: Sequence[_HeadInput], *, record: bool = True) -> list[torch.Tensor]:
        """Run the head; `record` marks the slots as computed from the target's hidden state
        (draft positions use the head's own output instead and are marked invalid)."""
        spans, row = [], 0
        for item in inputs:
            spans.append(ChunkSpan(row, len(item.positions), item.positions[0], item.table))
            row += len(item.positions)
            for p, token in zip(item.positions, item.next_tokens, strict=True):
                self.next_token[self._slot(item.table, p)] = token if record else -1
        meta = build_attention_meta(
            spans, block_size=self.block_size, window=None, device=self.device
        )
        ctx = ForwardContext(
            self.cache,
            layer_group=self.layer_group,
            attention={self.group_id: meta},
            states={},
            num_tokens=row,
        )
        tokens = torch.tensor(
            [t for i in inputs for t in i.next_tokens], dtype=torch.long, device=self.device
        )
        positions = torch.tensor(
            [p for i in inputs for p in i.positions], dtype=torch.long, device=self.device
        )
        states = torch.stack([h for i in inputs for h in i.hidden])
        out = self.head(self.target.embed(tokens), states, positions, ctx)
        return list(torch.split(out, [len(i.positions) for i in inputs]))

    def _draft(self, drafting: list[tuple[_HeadInput, torch.Tensor]]) -> dict[str, tuple[int, ...]]:
        drafts: dict[str, list[int]] = {item.req_id: [] for item, _ in drafting}
        current = [(item, state, item.positions[-1]) for item, state in drafting]
        for step in range(self.num_tokens):
            logits = self.target.compute_logits(torch.stack([s for _, s, _ in current]))
            tokens = greedy_tokens(logits).tolist()
            for (item, _, _), token in zip(current, tokens, strict=True):
                drafts[item.req_id].append(int(token))
            if step == self.num_tokens - 1:
                break
            nxt = [
                _HeadInput(item.req_id, item.table, [position + 1], [state], [token], True)
                for (item, state, position), token in zip(current, tokens, strict=True)
            ]
            outs = self._run(nxt, record=False)
            current = [(i, o[-1], i.positions[0]) for i, o in zip(nxt, outs, strict=True)]
        return {req_id: tuple(tokens) for req_id, tokens in drafts.items()}
