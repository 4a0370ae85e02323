"""The checks every model with recurrent state (Qwen3-Next, Qwen3.5, Bamba, Granite 4 hybrid)
passes against transformers on a tiny random checkpoint: single request (tokens and logits within
1e-4), chunked prefill of a mixed batch, prefix-cache resume from a state snapshot, preemption
with recompute and n-gram speculation; a zeroed state carry and a rollback that keeps rejected
drafts must be caught. A test module subclasses `StateModelChecks` as `Test...` and defines a
`checkpoint` fixture giving (checkpoint folder, transformers model), vocabulary `VOCAB`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hybridserve.executor.torch import forward as forward_module
from tests.reference.helpers import GreedyChecks

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


# Prefill in pieces of 67 and 3 tokens: the first crosses the delta rule's 64-token chunk (and
# Mamba2's 16-token chunks) and ends inside a block; decoding continues the state. A 13-token
# budget shared by four requests splits blocks (4) at every offset.
CHECKS = GreedyChecks(
    single=(70, 8, 67),
    batch=((5, 11, 30, 70), 6, 13),
    resume_answer=6,
    preempt=(14, 30),
    ngram_answer=32,
    ngram_accepts=True,
)
check_single_request = CHECKS.single_request
check_chunked_batch = CHECKS.chunked_batch
check_prefix_resume = CHECKS.prefix_resume
check_preemption = CHECKS.preemption
check_ngram_speculation = CHECKS.ngram_speculation


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
