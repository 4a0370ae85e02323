"""The torch executor's sharded attention pieces: per-chunk local keys on a rank, and partial
attention by chunk with its log-sum-exp (the fused CPU kernel and the plain computation agree,
and a query with no key is out 0, LSE -inf on both)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.executor.torch.forward import ChunkSpan, build_shard_meta
from hybridserve.parallel import DcpGroup
from hybridserve.parallel import attention as attention_module
from hybridserve.parallel.attention import partial_attention_chunks


def _reference(q, k, v, mask, scale):  # type: ignore[no-untyped-def]
    """Per (chunk, query, head): softmax over the unmasked keys, in float64."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bqhk", q, k).double() * scale
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bqhk,bkhd->bqhd", torch.softmax(scores, dim=-1), v.double())
    return out, lse


@pytest.mark.parametrize("fused", [True, False], ids=["fused_cpu_kernel", "plain"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_partial_attention_matches_softmax_and_its_log_sum_exp(
    fused: bool, kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not fused:
        monkeypatch.setattr(attention_module, "_FLASH_WITH_LSE", None)
    gen = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(3, 5, 4, 8, generator=gen)
    k = torch.randn(3, 7, kv_heads, 8, generator=gen)
    v = torch.randn(3, 7, kv_heads, 8, generator=gen)
    mask = torch.rand(3, 5, 7, generator=gen) > 0.4
    mask[:, :, 0] = True
    mask[1, 2] = False  # a query with no key on this rank
    out, lse = partial_attention_chunks(q, k, v, mask, scale=0.3)
    ref_out, ref_lse = _reference(q, k, v, mask, 0.3)
    has_keys = mask.any(dim=-1)
    torch.testing.assert_close(out[has_keys].double(), ref_out[has_keys], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[has_keys].double(), ref_lse[has_keys], atol=1e-5, rtol=1e-5)
    assert not out[~has_keys].any() and torch.isneginf(lse[~has_keys]).all()


def test_partial_attention_without_local_keys_is_empty_not_an_error() -> None:
    q = torch.randn(2, 3, 4, 8)
    out, lse = partial_attention_chunks(
        q,
        torch.empty(2, 0, 2, 8),
        torch.empty(2, 0, 2, 8),
        torch.zeros(2, 3, 0, dtype=torch.bool),
        scale=1.0,
    )
    assert out.shape == (2, 3, 4, 8) and not out.any()
    assert torch.isneginf(lse).all()


def test_shard_meta_gives_each_rank_its_own_tokens_of_every_chunk() -> None:
    block_size, world = 2, 2
    # Two chunks: positions 4..6 of a sequence (table [7, 3]) and a fresh 1-token prompt.
    spans = [ChunkSpan(0, 3, 4, [7, 3]), ChunkSpan(3, 1, 0, [5])]
    seen: dict[int, set[int]] = {}
    for rank in range(world):
        dcp = DcpGroup(rank=rank, world_size=world)
        meta = build_shard_meta(spans, block_size=block_size, dcp=dcp, device=torch.device("cpu"))
        # Token t lives on rank t % 2: rank 0 writes rows for positions 4 and 6 and position 0.
        owned_rows = (meta.slots >= 0).nonzero().flatten().tolist()
        assert owned_rows == ([0, 2, 3] if rank == 0 else [1])
        # Chunk 0's queries (positions 4, 5, 6) see this rank's positions up to their own.
        keys = meta.key_positions.tolist()
        for q, position in enumerate((4, 5, 6)):
            visible = {keys[j] for j in range(len(keys)) if meta.mask[0, q, j]}
            assert visible == {p for p in range(position + 1) if p % world == rank}
            seen.setdefault(position, set()).update(visible)
        # Local key j of a sequence sits in block table[j // 2] at offset j % 2.
        assert meta.key_slots[0, :4].tolist() == [14, 15, 6, 7][: meta.mask.shape[2]]
        assert meta.counts.tolist() == meta.mask[meta.query_valid].sum(-1).tolist()
    assert seen[6] == set(range(7))  # together the ranks cover the whole prefix


@st.composite
def _sharded_steps(draw: st.DrawFn) -> tuple[list[ChunkSpan], int, int, int]:
    world = draw(st.integers(1, 4))
    interleave = draw(st.integers(1, 3))
    block_size = interleave * draw(st.integers(1, 3))  # the executor requires I | block_size
    spans, row = [], 0
    for _ in range(draw(st.integers(1, 4))):
        start = draw(st.integers(0, 40))
        num = draw(st.integers(1, 12))
        blocks = -(-(start + num) // (block_size * world))
        table = draw(st.lists(st.integers(0, 500), min_size=blocks, max_size=blocks, unique=True))
        spans.append(ChunkSpan(row, num, start, table))
        row += num
    return spans, world, interleave, block_size


@settings(max_examples=60, deadline=None)
@given(_sharded_steps())
def test_ranks_partition_every_rows_causal_keys_and_own_each_row_once(
    step: tuple[list[ChunkSpan], int, int, int],
) -> None:
    spans, world, interleave, block_size = step
    num_rows = sum(s.num_tokens for s in spans)
    owners = torch.zeros(num_rows, dtype=torch.long)
    visible: list[list[int]] = [[] for _ in range(num_rows)]
    for rank in range(world):
        dcp = DcpGroup(rank=rank, world_size=world, interleave=interleave)
        meta = build_shard_meta(spans, block_size=block_size, dcp=dcp, device=torch.device("cpu"))
        owners += meta.slots >= 0
        for b, span in enumerate(spans):
            for q in range(span.num_tokens):
                keys = meta.key_positions[meta.mask[b, q]].tolist()
                visible[span.row_start + q].extend(keys)
                slot = int(meta.slots[span.row_start + q])
                if slot >= 0:  # written where a later read of that position looks
                    j = meta.key_positions.tolist().index(span.start + q)
                    assert slot == int(meta.key_slots[b, j])
                local = meta.mask[b, q].nonzero().flatten()
                # local key j of the sequence: block table[j // bs], offset j % bs
                table = torch.tensor(span.table)
                expected = table[local // block_size] * block_size + local % block_size
                assert meta.key_slots[b, local].tolist() == expected.tolist()
        assert meta.counts.tolist() == [
            int(meta.mask[b, q].sum()) for b, s in enumerate(spans) for q in range(s.num_tokens)
        ]
    assert owners.tolist() == [1] * num_rows  # each new token's K/V is written by one rank
    for span in spans:
        for q in range(span.num_tokens):
            keys = visible[span.row_start + q]
            assert sorted(keys) == list(range(span.start + q + 1))  # no key twice, none missing


def test_the_executor_refuses_an_interleave_that_does_not_divide_the_block() -> None:
    from hybridserve.core.errors import ConfigError
    from hybridserve.executor.torch import TorchExecutor
    from hybridserve.executor.torch.loader import build_model

    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
    }
    dcp = DcpGroup(rank=0, world_size=2, interleave=3)
    with pytest.raises(ConfigError, match="interleave"):
        TorchExecutor(build_model(config), num_blocks=8, block_size=4, dcp=dcp)
