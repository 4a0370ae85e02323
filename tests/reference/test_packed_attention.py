"""Packed attention: a mixed step computes each chunk's own scores, no padding to the longest
chunk, and gives the tokens the same requests get when they run in separate steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridserve.core.plan import ScheduledChunk, StepPlan
from hybridserve.executor.torch import TorchExecutor, load_model
from hybridserve.executor.torch.forward import MAX_KEY_PADDING, MAX_SHARED_QUERIES
from tests.reference.helpers import make_checkpoint

BLOCK = 16
LAYERS, HEADS = 2, 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.1,
        architectures=["LlamaForCausalLM"],
    )
    path = tmp_path_factory.mktemp("packed")
    make_checkpoint(config, path)
    return path


class _Blocks:
    def __init__(self) -> None:
        self.next = 1

    def take(self, num_tokens: int) -> tuple[int, ...]:
        count = -(-num_tokens // BLOCK)
        self.next += count
        return tuple(range(self.next - count, self.next))


def _prompt(length: int, seed: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(1, 96, (length,), generator=gen).tolist())


def _chunk(req_id: str, start: int, tokens: tuple[int, ...], blocks: tuple[int, ...]) -> Any:
    return ScheduledChunk(req_id, start, tokens, (blocks,), True, new_request=bool(blocks))


def _mixed_step(folder: Path, decode_lengths: list[int], prefill: int, *, together: bool) -> Any:
    """Prefill one request per decode length, then run their decodes with one long prefill:
    in one step (`together`) or the decodes and the prefill in steps of their own. Returns
    the executor, the decodes' and prefill's tokens, and the mixed step's score elements."""
    executor = TorchExecutor(load_model(folder), num_blocks=256, block_size=BLOCK)
    blocks = _Blocks()
    prompts = {f"d{i}": _prompt(n, seed=i) for i, n in enumerate(decode_lengths)}
    first = [_chunk(r, 0, p, blocks.take(len(p) + 1)) for r, p in prompts.items()]
    sampled = executor.execute(StepPlan(0, tuple(first))).sampled_token_ids
    decodes = [_chunk(r, len(p), sampled[r], ()) for r, p in prompts.items()]
    long = _chunk("p", 0, _prompt(prefill, seed=99), blocks.take(prefill))
    if together:
        result = executor.execute(StepPlan(1, (long, *decodes))).sampled_token_ids
        return result, executor.attention_elements
    result = dict(executor.execute(StepPlan(1, tuple(decodes))).sampled_token_ids)
    result |= executor.execute(StepPlan(2, (long,))).sampled_token_ids
    return result, None


def test_mixed_step_computes_no_padded_scores_for_the_decodes(folder: Path) -> None:
    lengths = [40] * 12  # equal contexts: one decode call, no key padding either
    prefill = 300
    _, elements = _mixed_step(folder, lengths, prefill, together=True)
    needed = prefill * prefill + sum(n + 1 for n in lengths)  # per head and layer
    assert elements == needed * HEADS * LAYERS
    # Padding the decodes to the prefill's queries and keys would cost 13 * 300 * 300 each.
    assert elements < 2 * prefill * prefill * HEADS * LAYERS


def test_decodes_of_unequal_contexts_pad_keys_only_within_the_bound(folder: Path) -> None:
    lengths = [20, 33, 35, 36, 38, 70, 71, 90, 150, 151]
    prefill = 200
    _, elements = _mixed_step(folder, lengths, prefill, together=True)
    decode_needed = sum(n + 1 for n in lengths)
    decode_computed = elements // (HEADS * LAYERS) - prefill * prefill
    assert decode_needed <= decode_computed <= (1 + MAX_KEY_PADDING) * decode_needed


def test_mixed_step_emits_the_tokens_of_separate_steps(folder: Path) -> None:
    lengths = [20, 33, 35, 36, 38, 70, 71, 90, 150, 151]
    together, _ = _mixed_step(folder, lengths, 200, together=True)
    apart, _ = _mixed_step(folder, lengths, 200, together=False)
    assert together == apart


def _shared_prefix_run(folder: Path, *, share: bool, steps: int = 5, own: int = 16) -> Any:
    """Request a prefills 300 tokens; b, c, d then hit its first 256 (16 blocks) and bring `own`
    tokens of their own; all four decode `steps` tokens. Returns tokens, logits and the keys
    gathered in the steps after a's prefill."""
    # The gather path (CUDA, or the CPU without its paged decode kernel): on the CPU's kernel
    # decodes gather nothing, shared prefix or not.
    executor = TorchExecutor(
        load_model(folder),
        num_blocks=256,
        block_size=BLOCK,
        share_prefixes=share,
        paged_kernel=False,
    )
    executor.record_logits = True
    blocks = _Blocks()
    prefix = _prompt(256, seed=7)
    prompts = {"a": prefix + _prompt(44, seed=8)}
    prompts |= {r: prefix + _prompt(own, seed=9 + i) for i, r in enumerate("bcd")}
    shared = tuple(range(1, 17))
    tables = {"a": blocks.take(300 + steps + 1)}
    tables |= {r: shared + blocks.take(own + steps + 1) for r in "bcd"}
    tokens: dict[str, list[int]] = {r: [] for r in prompts}
    first = executor.execute(StepPlan(0, (_chunk("a", 0, prompts["a"], tables["a"]),)))
    tokens["a"].extend(first.sampled_token_ids["a"])
    chunks = [_chunk("a", 300, tuple(tokens["a"]), ())]
    chunks += [_chunk(r, 256, prompts[r][256:], tables[r]) for r in "bcd"]
    elements = 0
    for step in range(1, steps + 1):
        result = executor.execute(StepPlan(step, tuple(chunks))).sampled_token_ids
        elements += executor.gathered_keys
        for r, new in result.items():
            tokens[r].extend(new)
        chunks = [
            _chunk(r, len(prompts[r]) + len(tokens[r]) - 1, (tokens[r][-1],), ()) for r in prompts
        ]
    return prompts, tokens, executor.recorded_logits, elements


def test_chunks_sharing_prefix_blocks_match_transformers_and_read_the_prefix_once(
    folder: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    from tests.reference.helpers import transformers_greedy

    prompts, shared, logits, shared_elements = _shared_prefix_run(folder, share=True)
    _, alone, _, alone_elements = _shared_prefix_run(folder, share=False)
    assert shared == alone
    hf_model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    for r, prompt in prompts.items():
        want, want_logits = transformers_greedy(hf_model, prompt, len(shared[r]))
        assert shared[r] == want
        for got, expected in zip(logits[r], want_logits, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    # The 256 shared keys are gathered once per layer and step instead of four times.
    assert shared_elements <= alone_elements - 3 * 256 * 5 * LAYERS


def test_prefill_chunks_of_more_queries_than_the_cap_gather_their_shared_prefix_alone(
    folder: Path,
) -> None:
    # 17 queries each (MAX_SHARED_QUERIES + 1) after the 256 shared keys: the merge would
    # save 512 of 819 keys, but a chunk's hand-run scores cost more than that gather.
    assert MAX_SHARED_QUERIES == 16
    _, shared, _, shared_elements = _shared_prefix_run(folder, share=True, steps=1, own=17)
    _, alone, _, alone_elements = _shared_prefix_run(folder, share=False, steps=1, own=17)
    assert shared == alone
    assert shared_elements == alone_elements


def test_a_prefix_short_beside_the_chunks_own_keys_is_not_shared(folder: Path) -> None:
    # With 600 tokens of their own, sharing the 256 would save 27% of the keys: under
    # MIN_SHARED_FRACTION, where the hand-run merge costs more than the gather it saves.
    _, shared, _, shared_elements = _shared_prefix_run(folder, share=True, steps=2, own=600)
    _, alone, _, alone_elements = _shared_prefix_run(folder, share=False, steps=2, own=600)
    assert shared == alone
    assert shared_elements == alone_elements


def test_fresh_prompts_of_one_length_attend_in_one_causal_call_with_their_own_logits(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hybridserve.executor.torch.executor as executor_module

    metas: list[Any] = []
    original = executor_module.build_attention_meta

    def recording(*args: Any, **kwargs: Any) -> Any:
        metas.append(original(*args, **kwargs))
        return metas[-1]

    monkeypatch.setattr(executor_module, "build_attention_meta", recording)
    prompts = {f"r{i}": _prompt(37, seed=20 + i) for i in range(3)}

    def run(together: bool) -> dict[str, Any]:
        executor = TorchExecutor(load_model(folder), num_blocks=64, block_size=BLOCK)
        executor.record_logits = True
        blocks = _Blocks()
        chunks = [_chunk(r, 0, p, blocks.take(len(p) + 1)) for r, p in prompts.items()]
        steps = [tuple(chunks)] if together else [(c,) for c in chunks]
        for i, step in enumerate(steps):
            executor.execute(StepPlan(i, step))
        return {r: torch.stack(v) for r, v in executor.recorded_logits.items()}

    together = run(True)
    (call,) = metas[0].calls  # one call: SDPA's causal mask serves all three, no mask tensor
    assert call.num_seqs == 3 and call.causal and call.mask is None
    apart = run(False)
    for req_id in prompts:
        torch.testing.assert_close(together[req_id], apart[req_id], atol=1e-5, rtol=1e-5)
