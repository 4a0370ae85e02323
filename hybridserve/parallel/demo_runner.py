"""Greedy generation over one rank's paged KV shard: the executor's job in miniature.

`PagedGenerator` keeps block tables (block ids shared by all ranks; one id covers
`block_size * N` tokens) and this rank's caches, and runs steps that mix prefill chunks and
decodes of several sequences. `run_scenario` is the end-to-end check: chunked prefill, a second
sequence resuming from the first one's cached prefix, then batched decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hybridserve.parallel.demo_models import TinyDecoder
from hybridserve.parallel.group import DcpGroup
from hybridserve.parallel.layer import AttentionRows

__all__ = ["DecodeScenario", "PagedGenerator", "greedy_dense", "run_scenario"]


@dataclass
class _Sequence:
    tokens: list[int]
    block_ids: list[int]
    num_computed_tokens: int = 0
    output: list[int] = field(default_factory=list)


class PagedGenerator:
    """One rank's sequences and caches; every rank of the group runs the same calls."""

    def __init__(
        self,
        model: TinyDecoder,
        dcp: DcpGroup,
        *,
        block_size: int,
        num_blocks: int,
        max_tokens_per_seq: int,
    ) -> None:
        self.model = model
        self.dcp = dcp
        self.block_size = block_size
        self.tokens_per_block = block_size * dcp.world_size
        self.max_blocks_per_seq = math.ceil(max_tokens_per_seq / self.tokens_per_block)
        self.caches = model.new_caches(num_blocks=num_blocks, block_size=block_size)
        self._free_blocks = list(range(num_blocks))
        self.sequences: dict[str, _Sequence] = {}

    def add(
        self, name: str, prompt: list[int], *, prefix_of: str | None, prefix_tokens: int
    ) -> None:
        """Register a sequence; its first `prefix_tokens` reuse `prefix_of`'s cached blocks.

        `prefix_tokens` must be a multiple of `block_size * N`, the lookup unit of a sharded
        group, so that whole shared blocks hold exactly the prefix on every rank.
        """
        if prefix_tokens % self.tokens_per_block:
            raise ValueError(
                f"prefix_tokens={prefix_tokens} is not a multiple of block_size * dcp = "
                f"{self.tokens_per_block}"
            )
        shared = (
            self.sequences[prefix_of].block_ids[: prefix_tokens // self.tokens_per_block]
            if prefix_of
            else []
        )
        fresh = self.max_blocks_per_seq - len(shared)
        if fresh > len(self._free_blocks):
            raise ValueError(f"out of blocks: {name} needs {fresh}, {len(self._free_blocks)} free")
        block_ids = shared + [self._free_blocks.pop(0) for _ in range(fresh)]
        self.sequences[name] = _Sequence(list(prompt), block_ids, prefix_tokens)

    def step(self, chunks: list[tuple[str, int]]) -> None:
        """Compute the next `n` tokens of each named sequence in one batch; sample greedily for
        each sequence whose chunk reaches its last token."""
        token_ids: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        last_rows: list[tuple[str, int]] = []
        for name, num_tokens in chunks:
            seq = self.sequences[name]
            start = seq.num_computed_tokens
            token_ids += seq.tokens[start : start + num_tokens]
            positions += range(start, start + num_tokens)
            tables += [seq.block_ids] * num_tokens
            seq.num_computed_tokens += num_tokens
            if seq.num_computed_tokens == len(seq.tokens):
                last_rows.append((name, len(token_ids) - 1))
        rows = AttentionRows(torch.tensor(positions), torch.tensor(tables), self.block_size)
        logits = self.model.forward_paged(
            torch.tensor(token_ids), rows=rows, caches=self.caches, dcp=self.dcp
        )
        for name, row in last_rows:
            token = int(logits[row].argmax())
            self.sequences[name].tokens.append(token)
            self.sequences[name].output.append(token)


@dataclass(frozen=True)
class DecodeScenario:
    """Sequence `a` prefills in chunks; `b` shares `a`'s first `prefix_tokens` and prefills the
    rest in the same step as `a`'s first decode; both then decode together."""

    prompt_a: tuple[int, ...] = (
        3,
        14,
        15,
        9,
        26,
        5,
        35,
        8,
        9,
        7,
        9,
        32,
        38,
        4,
        6,
        26,
        43,
        38,
        32,
        7,
        9,
    )
    suffix_b: tuple[int, ...] = (50, 2, 8, 8, 41, 9, 7)
    prefix_tokens: int = 16
    chunk_tokens: int = 8
    max_new_tokens: int = 6
    block_size: int = 4

    def prompt_b(self) -> list[int]:
        return list(self.prompt_a[: self.prefix_tokens] + self.suffix_b)


def run_scenario(
    model: TinyDecoder, dcp: DcpGroup, scenario: DecodeScenario
) -> dict[str, list[int]]:
    """Greedy outputs of `a` and `b` with the KV sharded over `dcp`."""
    longest = max(len(scenario.prompt_a), len(scenario.prompt_b())) + scenario.max_new_tokens
    gen = PagedGenerator(
        model, dcp, block_size=scenario.block_size, num_blocks=64, max_tokens_per_seq=longest
    )
    gen.add("a", list(scenario.prompt_a), prefix_of=None, prefix_tokens=0)
    for start in range(0, len(scenario.prompt_a), scenario.chunk_tokens):
        gen.step([("a", min(scenario.chunk_tokens, len(scenario.prompt_a) - start))])
    gen.add("b", scenario.prompt_b(), prefix_of="a", prefix_tokens=scenario.prefix_tokens)
    while True:
        chunks = [
            (name, len(seq.tokens) - seq.num_computed_tokens)
            for name, seq in gen.sequences.items()
            if len(seq.output) < scenario.max_new_tokens
        ]
        if not chunks:
            return {name: seq.output for name, seq in gen.sequences.items()}
        gen.step(chunks)


def greedy_dense(model: TinyDecoder, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference greedy decode: recompute the whole sequence densely for every token."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(int(model.forward_dense(torch.tensor(tokens))[-1].argmax()))
    return tokens[len(prompt) :]
