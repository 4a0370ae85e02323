"""The recurrent-state machinery of the TorchExecutor on a toy hybrid model.

A toy recurrent layer (h_t = decay * h_{t-1} + tanh(W x_t)) feeds a full-attention layer. Its
greedy output under chunked prefill, Mamba-group prefix hits, preemption and n-gram drafts must
equal a recompute of the whole sequence in one chunk every step: the executor restores the exact
state the cache retained and commits draft states only once verified.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

from hybridserve.core.config import SchedulerConfig, SpeculativeConfig
from hybridserve.core.request import Request, SamplingParams
from hybridserve.engine.engine import Engine
from hybridserve.executor.torch import TorchExecutor, load_model
from hybridserve.executor.torch.models.base import (
    AttentionCache,
    CausalLM,
    LayerCache,
    StateCache,
    register_model,
)
from hybridserve.executor.torch.models.llama import LlamaAttention
from hybridserve.kvcache import KVCacheManager
from hybridserve.scheduler import Scheduler
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
    drafted = hybrid_generate(toy_checkpoint, prompts, max_tokens=16, drafts=3)
    assert drafted.num_drafted_steps > 0
    assert drafted.tokens == plain.tokens


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
    from hybridserve.executor.torch.executor import TorchExecutor

    monkeypatch.setattr(TorchExecutor, "_commit_states", lambda *args: None)
    with pytest.raises(AssertionError):
        test_draft_states_commit_only_the_accepted_prefix(toy_checkpoint)


@dataclass
class _Turns:
    answers: list[list[int]]
    logits: list[torch.Tensor]  # the second turn's, one row per answer token
    hit: int  # the second turn's admission hit
    tail_hits: int


def _session_turns(
    folder: Path,
    first: Sequence[int],
    extra: Sequence[int],
    *,
    max_tokens: int,
    drafts: int = 0,
    **config: Any,
) -> _Turns:
    """Two turns of one session on one engine: the second prompt is the first turn's prompt,
    its answer and `extra`; `drafts` n-gram drafts a step."""
    speculative = SpeculativeConfig.from_name("ngram", drafts) if drafts else None
    executor = TorchExecutor(
        load_model(folder),
        num_blocks=64,
        block_size=4,
        max_num_seqs=4,
        speculative=speculative or SpeculativeConfig(),
    )
    executor.record_logits = True
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=4096, **config),
        KVCacheManager(executor.cache_layout()),
        num_speculative_tokens=drafts,
    )
    engine = Engine(scheduler, executor)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    turns = _Turns([], [], 0, 0)
    prompt = list(first)
    for index in range(2):
        request = Request(
            req_id=f"t{index}", prompt_token_ids=tuple(prompt), sampling=params, session_id="a"
        )
        engine.add_request(request)
        answer: list[int] = []
        while engine.has_requests():
            step = engine.step()
            turns.hit = dict(step.scheduled.new_reqs).get("t1", turns.hit)
            for out in step.outputs:
                answer.extend(out.new_token_ids)
            scheduler.cache.check_invariants()
        turns.answers.append(answer)
        prompt = [*prompt, *answer, *extra]
    turns.logits = executor.recorded_logits["t1"]
    turns.tail_hits = scheduler.cache.pin_stats.tail_hits
    return turns


def test_an_exact_tail_resumes_the_next_turn_where_the_last_one_ended(
    toy_checkpoint: Path,
) -> None:
    first, extra = _prompts()[2], [3, 4, 5, 6, 7, 8]  # 21 prompt tokens, 5 answer tokens
    pinned = _session_turns(toy_checkpoint, first, extra, max_tokens=5, kv_pin_fraction=0.5)
    tail = _session_turns(
        toy_checkpoint, first, extra, max_tokens=5, kv_pin_fraction=0.5, kv_pin_exact_tail=True
    )
    # The first turn computed 21 + 5 - 1 = 25 tokens (the last answer token is not fed back):
    # its exact end, inside a 4-token block; a pin alone resumes at the last retained boundary.
    assert (tail.hit, tail.tail_hits) == (25, 1)
    assert pinned.hit < 25 and pinned.tail_hits == 0
    # The second turn equals a recompute of its whole prompt: tokens and logits.
    second = [*first, *tail.answers[0], *extra]
    fresh = hybrid_generate(toy_checkpoint, [second], max_tokens=5, max_num_batched_tokens=4096)
    assert tail.answers == pinned.answers
    assert tail.answers[1] == fresh.tokens["r0"]
    torch.testing.assert_close(
        torch.stack(tail.logits), torch.stack(fresh.logits["r0"]), atol=1e-5, rtol=0
    )


def test_an_exact_tail_under_speculation_resumes_from_the_verified_state(
    toy_checkpoint: Path,
) -> None:
    # Repetitive prompts so that n-gram drafts are proposed and partly accepted.
    first, extra = [5, 6, 7, 8] * 5 + [5], [9, 10, 11] * 3
    tail = _session_turns(
        toy_checkpoint,
        first,
        extra,
        max_tokens=9,
        drafts=3,
        kv_pin_fraction=0.5,
        kv_pin_exact_tail=True,
    )
    assert tail.tail_hits == 1 and tail.hit == len(first) + 9 - 1
    second = [*first, *tail.answers[0], *extra]
    fresh = hybrid_generate(toy_checkpoint, [second], max_tokens=9, max_num_batched_tokens=4096)
    assert tail.answers[1] == fresh.tokens["r0"]
    torch.testing.assert_close(
        torch.stack(tail.logits), torch.stack(fresh.logits["r0"]), atol=1e-5, rtol=0
    )
    assert tail.answers[0] == _reference(toy_checkpoint, [first], 9)[0]


def _zero_state(cache: Any, layer_index: int, src: int, dst: int) -> None:
    for tensor in cache._states(layer_index).values():
        tensor[dst].zero_()


def _zero_tokens(cache: Any, layer_index: int, src: int, dst: int, num_tokens: int) -> None:
    bs = cache.block_size
    for tensor in cache.kv(layer_index):
        tensor[dst * bs : dst * bs + num_tokens] = 0


@pytest.mark.parametrize("copy", ["copy_state", "copy_tokens"])
def test_comparisons_catch_a_tail_resumed_without_its_block_copy(
    toy_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, copy: str
) -> None:
    """The copy target is a fresh block: resuming without the copy reads zeros."""
    from hybridserve.executor.torch.cache import DeviceCache

    broken = _zero_state if copy == "copy_state" else _zero_tokens
    monkeypatch.setattr(DeviceCache, copy, broken)
    with pytest.raises(AssertionError):
        test_an_exact_tail_resumes_the_next_turn_where_the_last_one_ended(toy_checkpoint)
