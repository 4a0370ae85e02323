"""Token sharding: owners, local lengths and cache slots agree with SPEC.md 4.1 and kvcache.dcp."""

from __future__ import annotations

import pytest
import torch

from hybridserve.kvcache.dcp import dcp_local_seq_lens
from hybridserve.parallel import DcpGroup, local_seq_lens
from hybridserve.parallel.demo_models import TINY_MODELS, TinyDecoder
from hybridserve.parallel.demo_runner import PagedGenerator
from hybridserve.parallel.sharding import (
    global_positions,
    local_positions,
    num_local_tokens,
    owner_ranks,
    slot_mapping,
)


@pytest.mark.parametrize(
    ("num_tokens", "interleave", "expected"),
    [(10, 1, [3, 3, 2, 2]), (2, 1, [1, 1, 0, 0]), (40, 16, [16, 16, 8, 0])],
)
def test_local_seq_lens_match_the_spec_table(num_tokens, interleave, expected):
    assert local_seq_lens(num_tokens, world_size=4, interleave=interleave) == expected


@pytest.mark.parametrize(("world_size", "interleave"), [(1, 1), (2, 1), (4, 1), (4, 2), (3, 4)])
def test_tensor_local_counts_agree_with_the_cache_geometry(world_size, interleave):
    lengths = torch.arange(0, 70)
    for rank in range(world_size):
        counts = num_local_tokens(lengths, rank=rank, world_size=world_size, interleave=interleave)
        expected = [
            dcp_local_seq_lens(int(n), world_size=world_size, interleave=interleave)[rank]
            for n in lengths
        ]
        assert counts.tolist() == expected


@pytest.mark.parametrize(("world_size", "interleave"), [(2, 1), (4, 1), (4, 2), (3, 4)])
def test_each_rank_holds_its_tokens_in_order_at_consecutive_local_positions(world_size, interleave):
    positions = torch.arange(64)
    owners = owner_ranks(positions, world_size=world_size, interleave=interleave)
    local = local_positions(positions, world_size=world_size, interleave=interleave)
    assert owners.tolist() == [
        t // interleave % world_size
        for t in range(64)  # SPEC.md 4.1: floor(t / I) mod N
    ]
    for rank in range(world_size):
        mine = local[owners == rank]
        assert mine.tolist() == list(range(len(mine)))
        back = global_positions(mine, rank=rank, world_size=world_size, interleave=interleave)
        assert back.tolist() == positions[owners == rank].tolist()


def test_slot_mapping_writes_every_token_once_and_a_block_id_covers_block_size_times_width():
    world_size, interleave, block_size = 4, 2, 4
    positions = torch.arange(40)
    block_ids = torch.tensor([7, 3, 9, 0])
    tables = block_ids.expand(len(positions), -1)
    written = torch.zeros(len(positions), dtype=torch.long)
    for rank in range(world_size):
        dcp = DcpGroup(rank=rank, world_size=world_size, interleave=interleave)
        slots = dcp.slot_mapping(positions, tables, block_size)
        owned = slots >= 0
        written += owned.long()
        blocks = torch.div(slots[owned], block_size, rounding_mode="floor")
        logical = torch.div(positions[owned], block_size * world_size, rounding_mode="floor")
        assert blocks.tolist() == block_ids[logical].tolist()
        assert len(set(slots[owned].tolist())) == int(owned.sum())
    assert written.tolist() == [1] * len(positions)


def test_slot_mapping_rejects_a_block_size_the_interleave_does_not_divide():
    with pytest.raises(ValueError, match="interleave"):
        slot_mapping(
            torch.arange(4),
            torch.zeros(4, 1, dtype=torch.long),
            block_size=6,
            rank=0,
            world_size=2,
            interleave=4,
        )


def test_dcp_group_rejects_a_rank_outside_the_group():
    with pytest.raises(ValueError, match=r"dcp\.rank"):
        DcpGroup(rank=2, world_size=2)


def test_a_shared_prefix_must_cover_whole_sharded_blocks():
    dcp = DcpGroup(rank=1, world_size=2)
    gen = PagedGenerator(
        TinyDecoder(TINY_MODELS["gqa"], seed=0),
        dcp,
        block_size=4,
        num_blocks=8,
        max_tokens_per_seq=24,
    )
    gen.add("a", list(range(20)), prefix_of=None, prefix_tokens=0)
    with pytest.raises(ValueError, match="multiple of block_size"):
        gen.add("b", list(range(20)), prefix_of="a", prefix_tokens=4)
    gen.add("c", list(range(20)), prefix_of="a", prefix_tokens=16)
    assert gen.sequences["c"].block_ids[:2] == gen.sequences["a"].block_ids[:2]
