"""The log-sum-exp merge is exact and masks empty ranks (SPEC.md 4.3)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridserve.parallel import merge_attention_states
from hybridserve.parallel.attention import partial_attention
from hybridserve.parallel.sharding import owner_ranks

HEADS, DIM = 3, 5
GARBAGE = (float("nan"), 0.0, float("inf"), 1e30)


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One row: q [heads, d], k/v [keys, heads, d]."""
    scores = torch.einsum("hd,thd->ht", q, k) * DIM**-0.5
    return torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), v)


def sharded_partials(lengths, *, world_size, interleave, seed, garbage=GARBAGE):
    """Random rows, each attending over its own keys split across ranks; empty ranks hold
    garbage. Returns (outputs, lses, counts, expected)."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    outputs = torch.empty(world_size, rows, HEADS, DIM, dtype=torch.float64)
    lses = torch.empty(world_size, rows, HEADS, dtype=torch.float64)
    counts = torch.zeros(world_size, rows, dtype=torch.long)
    expected = torch.zeros(rows, HEADS, DIM, dtype=torch.float64)
    for row, length in enumerate(lengths):
        q = torch.randn(HEADS, DIM, generator=gen, dtype=torch.float64)
        k = torch.randn(length, HEADS, DIM, generator=gen, dtype=torch.float64)
        v = torch.randn(length, HEADS, DIM, generator=gen, dtype=torch.float64)
        if length:
            expected[row] = full_attention(q, k, v)
        owners = owner_ranks(torch.arange(length), world_size=world_size, interleave=interleave)
        for rank in range(world_size):
            mine = owners == rank
            counts[rank, row] = int(mine.sum())
            if not mine.any():
                value = garbage[(row + rank) % len(garbage)]
                outputs[rank, row], lses[rank, row] = value, value
                continue
            out, lse = partial_attention(
                q[None],
                k[mine][None],
                v[mine][None],
                torch.ones(1, int(mine.sum()), dtype=torch.bool),
                scale=DIM**-0.5,
            )
            outputs[rank, row], lses[rank, row] = out[0], lse[0]
    return outputs, lses, counts, expected


@pytest.mark.parametrize(("world_size", "interleave"), [(1, 1), (2, 1), (4, 1), (4, 3), (8, 2)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merge_equals_unsharded_attention_with_empty_ranks(world_size, interleave, seed):
    lengths = torch.randint(1, 40, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    lengths[:3] = [1, 2, 3]
    outputs, lses, counts, expected = sharded_partials(
        lengths, world_size=world_size, interleave=interleave, seed=seed
    )
    merged, _ = merge_attention_states(outputs, lses, counts)
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-10)


def test_merge_lse_is_the_log_sum_exp_of_all_scores():
    outputs, lses, counts, _ = sharded_partials([7, 1, 30], world_size=4, interleave=2, seed=5)
    _, merged_lse = merge_attention_states(outputs, lses, counts)
    live = torch.where(counts.unsqueeze(-1) > 0, lses, torch.full_like(lses, float("-inf")))
    torch.testing.assert_close(merged_lse, torch.logsumexp(live, dim=0), rtol=0, atol=1e-10)


def test_one_token_sequences_take_the_single_value_exactly():
    outputs, lses, counts, expected = sharded_partials(
        [1, 1, 1], world_size=4, interleave=1, seed=3
    )
    merged, _ = merge_attention_states(outputs, lses, counts)
    assert counts[1:].sum() == 0
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("garbage", GARBAGE)
def test_rows_empty_on_every_rank_merge_to_zero_output_and_minus_inf_lse(garbage):
    outputs = torch.full((4, 2, HEADS, DIM), garbage, dtype=torch.float64)
    lses = torch.full((4, 2, HEADS), garbage, dtype=torch.float64)
    counts = torch.zeros(4, 2, dtype=torch.long)
    merged, merged_lse = merge_attention_states(outputs, lses, counts)
    assert not merged.isnan().any() and not merged_lse.isnan().any()
    assert (merged == 0).all()
    assert (merged_lse == float("-inf")).all()


def test_merge_reproduces_the_spec_worked_example_and_ignores_the_empty_rank():
    outputs = torch.stack(
        [
            torch.full((1, 1, 1), 1.0),
            torch.full((1, 1, 1), 2.0),
            torch.full((1, 1, 1), float("nan")),
        ]
    ).double()
    lses = torch.tensor([[[2.0]], [[1.0]], [[0.0]]], dtype=torch.float64)
    counts = torch.tensor([[4], [3], [0]])
    merged, merged_lse = merge_attention_states(outputs, lses, counts)
    assert merged_lse.item() == pytest.approx(math.log(math.e**2 + math.e), abs=1e-12)
    assert merged_lse.item() == pytest.approx(2.3133, abs=1e-4)
    assert merged.item() == pytest.approx(0.7311 * 1.0 + 0.2689 * 2.0, abs=1e-4)


def naive_merge(outputs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """The merge without masking: what a kernel does if it trusts every rank's buffers."""
    total = torch.logsumexp(lses, dim=0)
    return (torch.exp(lses - total).unsqueeze(-1) * outputs).sum(dim=0)


@pytest.mark.parametrize(("garbage", "symptom"), [(0.0, "contaminated"), (float("nan"), "nan")])
def test_the_equality_check_catches_an_unmasked_empty_rank(garbage, symptom):
    outputs, lses, counts, expected = sharded_partials(
        [2, 5, 9], world_size=4, interleave=1, seed=11, garbage=(garbage,)
    )
    assert (counts == 0).any()
    naive = naive_merge(outputs, lses)
    if symptom == "nan":
        assert naive.isnan().any()
    else:
        assert (naive - expected).abs().max() > 1e-3
    with pytest.raises(AssertionError):
        torch.testing.assert_close(naive, expected, rtol=0, atol=1e-10)
    merged, _ = merge_attention_states(outputs, lses, counts)
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-10)


def test_merge_of_zero_rows_returns_empty_results():
    merged, merged_lse = merge_attention_states(
        torch.empty(4, 0, HEADS, DIM), torch.empty(4, 0, HEADS), torch.empty(4, 0, dtype=torch.long)
    )
    assert merged.shape == (0, HEADS, DIM) and merged_lse.shape == (0, HEADS)


def test_merge_rejects_mismatched_shapes_and_zero_ranks():
    with pytest.raises(ValueError, match="num_local_tokens"):
        merge_attention_states(torch.zeros(2, 3, 1, 1), torch.zeros(2, 3, 1), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="at least one rank"):
        merge_attention_states(torch.zeros(0, 3, 1, 1), torch.zeros(0, 3, 1), torch.zeros(0, 3))
