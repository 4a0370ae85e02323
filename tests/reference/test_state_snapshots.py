"""The recurrent-state machinery of the TorchExecutor on a toy hybrid model.

A toy recurrent layer (h_t = decay * h_{t-1} + tanh(W x_t)) feeds a full-attention layer. Its
greedy output under chunked prefill, Mamba-group prefix hits, preemption and n-gram drafts must
equal a recompute of the whole sequence in one chunk every step: the executor restores the exact
state the cache retained and commits draft states only once verified.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

from hybridserve.executor.torch.models.base import (
    AttentionCache,
    CausalLM,
    LayerCache,
    StateCache,
    register_model,
)
from hybridserve.executor.torch.models.llama import LlamaAttention
from tests.reference.helpers import hybrid_generate

if TYPE_CHECKING:
    from hybridserve.executor.torch.forward import ForwardContext

HIDDEN, VOCAB = 32, 48


class ToyRecurrence(nn.Module):
    def __init__(self, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)
        self.decay = nn.Parameter(torch.full((HIDDEN,), 0.9))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        u = torch.tanh(self.inp(x))
        hs = torch.empty_like(u)
        for chunk in ctx.state_chunks(self.layer_index):
            state = ctx.load_state(self.layer_index, chunk)["h"]
            snapshots = set(chunk.snapshots)
            for n, row in enumerate(range(chunk.rows.start, chunk.rows.stop), start=1):
                state = self.decay * state + u[row]
                hs[row] = state
                if n in snapshots:
                    ctx.save_state(self.layer_index, chunk, n, {"h": state})
        return x + self.out(hs)


@register_model("ToyHybridForCausalLM")
class ToyHybrid(CausalLM):
    def __init__(self, config: dict[str, Any], dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, dtype)
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.recurrence = ToyRecurrence(0)
        attn_config = {"hidden_size": HIDDEN, "num_attention_heads": 4, "num_key_value_heads": 2}
        self.attention = LlamaAttention(attn_config, 1)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def layer_caches(self) -> list[LayerCache]:
        return [StateCache({"h": (HIDDEN,)}), AttentionCache(2, HIDDEN // 4)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = self.recurrence(self.embed(input_ids), ctx)
        return x + self.attention(x, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("toy-hybrid")
    torch.manual_seed(0)
    model = ToyHybrid({"hidden_size": HIDDEN, "vocab_size": VOCAB})
    for param in model.parameters():
        nn.init.normal_(param, std=0.3)
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["ToyHybridForCausalLM"], "hidden_size": HIDDEN})
    )
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "w.safetensors")
    return folder


def _reference(folder: Path, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Greedy by recomputing prompt + output in one chunk, one fresh request per token."""
    outputs = []
    for prompt in prompts:
        tokens = list(prompt)
        for _ in range(max_tokens):
            run = hybrid_generate(
                folder, [tokens], max_tokens=1, max_num_batched_tokens=4096, block_size=4
            )
            tokens.append(run.tokens["r0"][0])
        outputs.append(tokens[len(prompt) :])
    return outputs


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (6, 13, 21)]


def test_chunked_prefill_restores_the_state_between_chunks(toy_checkpoint: Path) -> None:
    prompts = _prompts()
    run = hybrid_generate(toy_checkpoint, prompts, max_tokens=6, max_num_batched_tokens=5)
    assert [run.tokens[f"r{i}"] for i in range(3)] == _reference(toy_checkpoint, prompts, 6)


def test_state_group_prefix_hit_resumes_from_the_retained_snapshot(toy_checkpoint: Path) -> None:
    first = _prompts()[2]
    prompts = [first, first + [3, 4, 5, 6, 7, 8]]
    run = hybrid_generate(toy_checkpoint, prompts, max_tokens=5, sequential=True)
    assert run.hit_tokens["r1"] >= 8, "the second request must hit the state group"
    assert [run.tokens["r0"], run.tokens["r1"]] == _reference(toy_checkpoint, prompts, 5)


def test_preempted_request_recomputes_its_state(toy_checkpoint: Path) -> None:
    prompts = _prompts()
    run = hybrid_generate(toy_checkpoint, prompts, max_tokens=12, num_blocks=22)
    assert run.num_preemptions > 0
    assert [run.tokens[f"r{i}"] for i in range(3)] == _reference(toy_checkpoint, prompts, 12)


def test_draft_states_commit_only_the_accepted_prefix(toy_checkpoint: Path) -> None:
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5]
    plain = hybrid_generate(toy_checkpoint, prompts, max_tokens=16)
    spec = hybrid_generate(toy_checkpoint, prompts, max_tokens=16, spec_tokens=3)
    assert spec.num_drafted_steps > 0
    assert spec.tokens == plain.tokens


def test_comparisons_catch_a_dropped_state_carry(
    toy_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridserve.executor.torch.cache import DeviceCache

    original = DeviceCache.read_state
    monkeypatch.setattr(
        DeviceCache, "read_state", lambda self, layer, slot: original(self, layer, None)
    )
    with pytest.raises(AssertionError):
        test_chunked_prefill_restores_the_state_between_chunks(toy_checkpoint)


def test_comparisons_catch_uncommitted_draft_states(
    toy_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridserve.executor.torch.runner import TorchExecutor

    monkeypatch.setattr(TorchExecutor, "_commit_states", lambda *args: None)
    with pytest.raises(AssertionError):
        test_draft_states_commit_only_the_accepted_prefix(toy_checkpoint)
