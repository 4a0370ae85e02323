"""Sliding-window attention metadata: a chunk longer than the window attends in window pieces."""

from __future__ import annotations

import torch

from hybridserve.executor.torch.forward import (
    ChunkSpan,
    build_attention_meta,
    window_piece,
    window_pieces,
)


def test_long_prefill_under_a_window_computes_scores_for_the_window_only() -> None:
    block_size, window, tokens = 16, 512, 4096
    table = list(range(tokens // block_size))
    meta = build_attention_meta(
        [ChunkSpan(0, tokens, 0, table)],
        block_size=block_size,
        window=window,
        device=torch.device("cpu"),
    )
    # Every query attends over at most window + window / 2 - 1 keys (pieces of half a window,
    # padding within a call included), where one call over the whole chunk would compute
    # tokens x tokens scores, and pieces of a whole window nearly 2 x window a query.
    assert window_piece(window) == window // 2
    assert meta.computed_elements <= tokens * (window + window // 2 - 1)
    assert meta.num_rows == tokens
    assert torch.equal(meta.slot_mapping, torch.arange(tokens))


def test_window_pieces_keep_rows_positions_and_tables_in_order() -> None:
    spans = [ChunkSpan(0, 1, 40, [7]), ChunkSpan(1, 20, 3, [1, 2]), ChunkSpan(21, 8, 0, [5])]
    pieces = window_pieces(spans, 16)  # pieces of 8 queries
    assert [(p.row_start, p.num_tokens, p.start) for p in pieces] == [
        (0, 1, 40),
        (1, 8, 3),
        (9, 8, 11),
        (17, 4, 19),
        (21, 8, 0),
    ]
    assert [p.table for p in pieces] == [[7], [1, 2], [1, 2], [1, 2], [5]]
    assert [window_piece(w) for w in (1, 2, 3, 512)] == [1, 1, 2, 256]
