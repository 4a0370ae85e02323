"""The checks every model with recurrent state (Qwen3-Next, Qwen3.5, Bamba, Granite 4 hybrid)
passes against transformers on a tiny random checkpoint: single request (tokens and logits within
1e-4), chunked prefill of a mixed batch, prefix-cache resume from a state snapshot, preemption
with recompute and n-gram speculation; a zeroed state carry and a rollback that keeps rejected
drafts must be caught. A test module subclasses `StateModelChecks` as `Test...` and defines a
`checkpoint` fixture giving (checkpoint folder, transformers model), vocabulary `VOCAB`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridserve.executor.torch import forward as forward_module
from tests.reference.helpers import (
    assert_greedy_matches,
    hybrid_generate,
    random_prompt,
    transformers_greedy,
)

VOCAB = 96


@contextlib.contextmanager
def zero_state_at_chunk_starts() -> Iterator[None]:
    """Break the recurrent-state carry: every chunk starts from a zero state."""
    original = forward_module.ForwardContext.load_state

    def broken(self: Any, layer_index: int, chunk: Any) -> dict[str, torch.Tensor]:
        return {name: torch.zeros_like(t) for name, t in original(self, layer_index, chunk).items()}

    forward_module.ForwardContext.load_state = broken  # type: ignore[method-assign]
    try:
        yield
    finally:
        forward_module.ForwardContext.load_state = original  # type: ignore[method-assign]


@contextlib.contextmanager
def keep_rejected_draft_states() -> Iterator[None]:
    """Break the speculative rollback: every snapshot of a chunk ends up holding the chunk's
    last state, so after a verification step the state includes the rejected drafts."""
    original = forward_module.ForwardContext.save_state

    def broken(
        self: Any, layer_index: int, chunk: Any, num_tokens: int, state: dict[str, torch.Tensor]
    ) -> None:
        for count in chunk.snapshots:
            original(self, layer_index, chunk, count, state)

    forward_module.ForwardContext.save_state = broken  # type: ignore[method-assign]
    try:
        yield
    finally:
        forward_module.ForwardContext.save_state = original  # type: ignore[method-assign]


def check_single_request(folder: Path, hf_model: Any) -> None:
    # Prefill in pieces of 67 and 3 tokens: the first crosses the delta rule's 64-token chunk
    # (and Mamba2's 16-token chunks) and ends inside a block; decoding continues the state.
    prompt = random_prompt(70, seed=1)
    run = hybrid_generate(folder, [prompt], max_tokens=8, max_num_batched_tokens=67)
    want, want_logits = transformers_greedy(hf_model, prompt, 8)
    assert run.tokens["r0"] == want
    got_logits = torch.stack(run.logits["r0"])
    torch.testing.assert_close(got_logits, torch.stack(want_logits), atol=1e-4, rtol=0)


def check_chunked_batch(folder: Path, hf_model: Any) -> None:
    prompts = [random_prompt(n, seed=n) for n in (5, 11, 30, 70)]
    # A 13-token budget shared by four requests splits blocks (4) at every offset.
    run = hybrid_generate(folder, prompts, max_tokens=6, max_num_batched_tokens=13)
    assert_greedy_matches(hf_model, prompts, run)


def check_prefix_resume(folder: Path, hf_model: Any) -> None:
    first = random_prompt(30, seed=3)
    prompts = [first, first + random_prompt(9, seed=5)]
    run = hybrid_generate(folder, prompts, max_tokens=6, sequential=True)
    assert run.hit_tokens["r1"] >= 24, "the second request must resume from a state snapshot"
    assert_greedy_matches(hf_model, prompts, run)


def check_preemption(folder: Path, hf_model: Any) -> None:
    prompts = [random_prompt(18, seed=10 + i) for i in range(4)]
    run = hybrid_generate(folder, prompts, max_tokens=14, num_blocks=30)
    assert run.num_preemptions > 0, "num_blocks is meant to force preemption"
    assert_greedy_matches(hf_model, prompts, run)


def check_ngram_speculation(folder: Path, hf_model: Any) -> None:
    motif = random_prompt(6, seed=20)
    prompts = [motif * 4 + random_prompt(3, seed=21), random_prompt(9, seed=22) * 2]
    plain = hybrid_generate(folder, prompts, max_tokens=32)
    spec = hybrid_generate(folder, prompts, max_tokens=32, spec_tokens=3)
    # Both rejected drafts (state rolled back) and accepted ones (state committed) occur.
    assert spec.num_accepted_drafts > 0
    assert spec.num_drafted_steps * 3 > spec.num_accepted_drafts
    assert spec.tokens == plain.tokens
    assert_greedy_matches(hf_model, prompts, spec)


class StateModelChecks:
    def test_single_request_tokens_and_logits_match_transformers(self, checkpoint: Any) -> None:
        check_single_request(*checkpoint)

    def test_chunked_prefill_of_mixed_batch_matches_transformers(self, checkpoint: Any) -> None:
        check_chunked_batch(*checkpoint)

    def test_prefix_cache_resume_from_state_snapshot_matches_transformers(
        self, checkpoint: Any
    ) -> None:
        check_prefix_resume(*checkpoint)

    def test_preemption_and_recompute_continue_identically(self, checkpoint: Any) -> None:
        check_preemption(*checkpoint)

    def test_ngram_speculation_equals_plain_greedy(self, checkpoint: Any) -> None:
        check_ngram_speculation(*checkpoint)

    @pytest.mark.parametrize(
        "check", [check_single_request, check_chunked_batch, check_prefix_resume]
    )
    def test_comparisons_catch_a_zeroed_state_carry(self, checkpoint: Any, check: Any) -> None:
        with zero_state_at_chunk_starts(), pytest.raises(AssertionError):
            check(*checkpoint)

    def test_comparisons_catch_a_rollback_that_keeps_rejected_drafts(self, checkpoint: Any) -> None:
        with keep_rejected_draft_states(), pytest.raises(AssertionError):
            check_ngram_speculation(*checkpoint)
