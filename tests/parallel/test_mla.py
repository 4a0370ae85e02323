"""MLA: absorbed MQA-form attention over a paged latent cache equals the dense unabsorbed block,
sparse selection is exact, and a negative slot suppresses only the cache writes."""

from __future__ import annotations

import pytest
import torch

from hybridserve.parallel import AttentionRows, DcpGroup
from hybridserve.parallel.mla import (
    MlaCaches,
    MlaConfig,
    MlaWeights,
    mla_attention,
    mla_attention_dense,
    prepare_rows,
)
from hybridserve.parallel.sparse import select_top_k

BLOCK_SIZE = 4


def setup(cfg: MlaConfig, tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weights = MlaWeights.random(cfg, gen, torch.float64)
    x = torch.randn(tokens, cfg.hidden_size, generator=gen, dtype=torch.float64)
    return weights, x


def paged_prefill(weights, cfg, x, chunk_tokens):
    """Run a whole sequence through the paged absorbed path in chunks (one process)."""
    caches = MlaCaches.empty(cfg, num_blocks=16, block_size=BLOCK_SIZE, dtype=torch.float64)
    table = torch.tensor([5, 2, 11, 0, 7, 9, 1, 3])
    outs = []
    for start in range(0, x.shape[0], chunk_tokens):
        positions = torch.arange(start, min(start + chunk_tokens, x.shape[0]))
        rows = AttentionRows(positions, table.expand(len(positions), -1), BLOCK_SIZE)
        outs.append(
            mla_attention(weights, cfg, x[positions], rows=rows, caches=caches, dcp=DcpGroup())
        )
    return torch.cat(outs)


@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 23])
def test_absorbed_paged_mla_equals_the_dense_unabsorbed_block(top_k, chunk_tokens):
    cfg = MlaConfig(index_top_k=top_k)
    weights, x = setup(cfg, tokens=23)
    expected = mla_attention_dense(weights, cfg, x)
    torch.testing.assert_close(
        paged_prefill(weights, cfg, x, chunk_tokens), expected, rtol=0, atol=1e-10
    )


def test_sparse_selection_changes_the_result_once_the_context_exceeds_top_k():
    weights, x = setup(MlaConfig(index_top_k=0), tokens=23)
    dense = mla_attention_dense(weights, MlaConfig(index_top_k=0), x)
    sparse = mla_attention_dense(weights, MlaConfig(index_top_k=5), x)
    torch.testing.assert_close(sparse[:5], dense[:5], rtol=0, atol=1e-12)
    assert (sparse[5:] - dense[5:]).abs().max() > 1e-3


def test_top_k_keeps_the_best_valid_keys_and_breaks_ties_toward_earlier_positions():
    scores = torch.tensor([[0.0, 3.0, 0.0, 3.0, 0.0, 9.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, True, True, True, False]])
    chosen = select_top_k(scores, valid, torch.arange(6), k=3, dcp=DcpGroup())
    assert chosen.tolist() == [[True, True, False, True, False, False]]
    few = select_top_k(scores, valid, torch.arange(6), k=10, dcp=DcpGroup())
    assert few.tolist() == valid.tolist()


def test_negative_slot_suppresses_only_the_cache_writes_not_the_query_rows():
    cfg = MlaConfig(index_top_k=4)
    weights, x = setup(cfg, tokens=6)
    positions = torch.arange(10, 16)
    heads = slice(0, cfg.num_heads)
    owned = MlaCaches.empty(cfg, num_blocks=4, block_size=BLOCK_SIZE, dtype=torch.float64)
    foreign = MlaCaches.empty(cfg, num_blocks=4, block_size=BLOCK_SIZE, dtype=torch.float64)
    slots = torch.tensor([0, -1, 5, -1, -1, 9])
    kept = prepare_rows(
        weights, cfg, x, positions=positions, slots=torch.arange(6), caches=owned, heads=heads
    )
    got = prepare_rows(
        weights, cfg, x, positions=positions, slots=slots, caches=foreign, heads=heads
    )
    for name in ("q_nope", "q_pe", "index_q", "index_weights"):
        torch.testing.assert_close(getattr(got, name), getattr(kept, name), rtol=0, atol=0)
    flat_latent = foreign.latent.view(-1, cfg.latent_dim)
    flat_index = foreign.index_keys.view(-1, cfg.index_head_dim)
    written = flat_latent.abs().sum(dim=-1) != 0
    assert written.nonzero().flatten().tolist() == [0, 5, 9]
    assert (flat_index.abs().sum(dim=-1) != 0).nonzero().flatten().tolist() == [0, 5, 9]
    torch.testing.assert_close(
        flat_latent[[0, 5, 9]], owned.latent.view(-1, cfg.latent_dim)[[0, 2, 5]], rtol=0, atol=0
    )
