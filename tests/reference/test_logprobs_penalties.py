"""The torch executor's penalties (as vLLM defines them) and log-probabilities (generated and
prompt tokens), checked against transformers on the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridserve.core.errors import RequestError
from hybridserve.core.request import SamplingParams
from hybridserve.executor.torch.logits import PenaltyRow, apply_penalties, token_logprobs
from tests.reference.helpers import hybrid_generate, make_checkpoint

PROMPTS = [[1, 5, 9, 5, 5, 2, 7, 30, 31, 9], [3, 3, 3, 8, 12, 40, 41, 3]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("logprob-llama")
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,
        architectures=["LlamaForCausalLM"],
    )
    return path, make_checkpoint(config, path)


def _full_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of `tokens` (row i predicts token i + 1), one forward pass."""
    with torch.no_grad():
        ids = torch.tensor([tokens])
        positions = torch.arange(len(tokens))[None]
        return model(input_ids=ids, position_ids=positions, use_cache=False).logits[0].float()


def _vllm_penalized(row: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams):  # type: ignore[no-untyped-def]
    """The penalties written out token by token, from vLLM's definition."""
    out = row.clone()
    for token in range(row.shape[0]):
        if token in prompt or token in output:
            value = float(out[token])
            out[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        count = output.count(token)
        out[token] -= p.frequency_penalty * count
        out[token] -= p.presence_penalty * (count > 0)
    return out


def test_penalties_follow_vllm_definitions_token_by_token() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5], [1.0, 1.0, 1.0, 1.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [PenaltyRow(0, [0], [1, 1, 3], params)])
    assert out[0].tolist() == pytest.approx([1.0, -3.25, 0.5, 0.75, -0.5])
    assert torch.equal(out[1], logits[1])  # rows without penalties are untouched
    assert apply_penalties(logits, []) is logits


def test_greedy_with_penalties_matches_a_transformers_loop(checkpoint: tuple[Path, Any]) -> None:
    path, model = checkpoint
    params = SamplingParams(
        max_tokens=10,
        ignore_eos=True,
        repetition_penalty=1.8,
        frequency_penalty=0.7,
        presence_penalty=0.4,
    )
    want = []
    for prompt in PROMPTS:
        tokens = list(prompt)
        for _ in range(10):
            row = _full_logits(model, tokens)[-1]
            scored = _vllm_penalized(row, prompt, tokens[len(prompt) :], params)
            tokens.append(int(torch.argmax(scored)))
        want.append(tokens[len(prompt) :])
    plain = hybrid_generate(path, PROMPTS, max_tokens=10)
    assert [plain.tokens[f"r{i}"] for i in range(2)] != want  # the penalties change the output
    for options in ({}, {"max_num_batched_tokens": 3}, {"drafts": 3}):
        run = hybrid_generate(path, PROMPTS, sampling=params, **options)  # type: ignore[arg-type]
        assert [run.tokens[f"r{i}"] for i in range(2)] == want, options


def test_neutral_penalties_change_nothing(checkpoint: tuple[Path, Any]) -> None:
    path, _ = checkpoint
    neutral = SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1.0)
    assert not neutral.has_penalties
    assert hybrid_generate(path, PROMPTS, sampling=neutral).tokens == (
        hybrid_generate(path, PROMPTS, max_tokens=8).tokens
    )


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 3}, {"drafts": 3}])
def test_logprobs_of_generated_and_prompt_tokens_match_transformers(
    checkpoint: tuple[Path, Any], options: dict[str, int]
) -> None:
    path, model = checkpoint
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    run = hybrid_generate(path, PROMPTS, sampling=params, **options)  # type: ignore[arg-type]
    for i, prompt in enumerate(PROMPTS):
        req = f"r{i}"
        tokens = [*prompt, *run.tokens[req]]
        reference = torch.log_softmax(_full_logits(model, tokens), dim=-1)
        generated, prompt_entries = run.logprobs[req], run.prompt_logprobs[req]
        assert [e.token_id for e in prompt_entries] == prompt[1:]
        assert [e.token_id for e in generated] == run.tokens[req]
        for position, entry in enumerate([*prompt_entries, *generated], start=1):
            row = reference[position - 1]
            assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
            want_top = torch.topk(row, len(entry.top)).indices.tolist()
            assert [t for t, _ in entry.top] == want_top
            assert [lp for _, lp in entry.top] == pytest.approx(
                [float(row[t]) for t in want_top], abs=1e-4
            )
        assert all(len(e.top) == 2 for e in prompt_entries)
        assert all(len(e.top) == 3 for e in generated)


def test_logprobs_are_of_the_raw_logits_while_penalties_steer_sampling(
    checkpoint: tuple[Path, Any],
) -> None:
    path, model = checkpoint
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0, repetition_penalty=1.8)
    run = hybrid_generate(path, PROMPTS[:1], sampling=params)
    tokens = [*PROMPTS[0], *run.tokens["r0"]]
    reference = torch.log_softmax(_full_logits(model, tokens), dim=-1)
    start = len(PROMPTS[0])
    for j, entry in enumerate(run.logprobs["r0"]):
        assert entry.top == ()
        assert entry.logprob == pytest.approx(
            float(reference[start + j - 1, entry.token_id]), abs=1e-4
        )


def test_requests_without_logprobs_get_none(checkpoint: tuple[Path, Any]) -> None:
    run = hybrid_generate(checkpoint[0], PROMPTS, max_tokens=3)
    assert run.logprobs == {"r0": [], "r1": []} and run.prompt_logprobs == {}


def test_token_logprobs_top_zero_lists_only_the_token() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    (entry,) = token_logprobs(logits, [0], 0)
    assert entry.top == () and entry.logprob == pytest.approx(
        float(torch.log_softmax(logits[0], -1)[0])
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("logprobs", 21),
        ("prompt_logprobs", -1),
    ],
)
def test_out_of_range_penalties_and_logprobs_are_refused(field: str, value: float) -> None:
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_prompt_logprobs_survive_preemption_once_each(checkpoint: tuple[Path, Any]) -> None:
    path, model = checkpoint
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    run = hybrid_generate(path, PROMPTS, sampling=params, num_blocks=6, max_num_batched_tokens=3)
    assert run.num_preemptions > 0
    for i, prompt in enumerate(PROMPTS):
        tokens = [*prompt, *run.tokens[f"r{i}"]]
        reference = torch.log_softmax(_full_logits(model, tokens), dim=-1)
        entries = [*run.prompt_logprobs[f"r{i}"], *run.logprobs[f"r{i}"]]
        assert [e.token_id for e in entries] == tokens[1:]
        for position, entry in enumerate(entries, start=1):
            assert entry.logprob == pytest.approx(
                float(reference[position - 1, entry.token_id]), abs=1e-4
            )
