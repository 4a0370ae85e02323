"""Pieces the recurrent layers share: the causal conv1d with its state, chunking, snapshot counts.

A recurrent layer processes one request's chunk of L tokens in one call and returns the state
after each count the cache asks for (`snapshots`, ascending, each in 1..L), so that a chunk
split at its snapshots and processed piece by piece gives the same states as one pass. The
step's decodes (one token each, their state saved after it) run together instead: their states
gathered into one batch, one batched step, the new states written back (`decode_batch`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from hybridserve.executor.torch.forward import StateChunk

State = dict[str, torch.Tensor]

# Chunks of at most this many tokens run the token loop, longer ones the chunked scan: where the
# loop was faster at real layer shapes on CPU, one thread (`benchmarks/recurrent_prefill.py
# --threshold` times both at lengths 1..16). The gated delta rule's loop wins up to 3 tokens
# (decode and short drafts; 0.46 against 0.86 ms at 1 token, 1.65 against 1.06 ms at 4 tokens
# at Qwen3-Next's shape); Mamba2's chunked scan is already faster at 1 token at Nemotron-H's.
GATED_DELTA_LOOP_MAX_TOKENS = 3
MAMBA2_LOOP_MAX_TOKENS = 1


def check_snapshots(snapshots: tuple[int, ...], num_tokens: int) -> None:
    """Snapshot counts must be ascending and inside the chunk (1..num_tokens)."""
    previous = 0
    for count in snapshots:
        if not previous < count <= num_tokens:
            raise ValueError(
                f"snapshots={snapshots}: give ascending token counts in 1..{num_tokens} "
                "(the state after that many tokens of the chunk)"
            )
        previous = count


def causal_conv1d(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    snapshots: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Depthwise causal convolution of `x` `[L, C]` continuing from `conv_state` `[C, K - 1]`
    (the K - 1 inputs before x); `weight` is `[C, K]`. Returns the output `[L, C]` (no
    activation), the state after the last token and the states after each snapshot count."""
    num_channels, kernel = weight.shape
    window = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)  # [C, K - 1 + L]
    out = F.conv1d(window[None], weight[:, None, :].to(x.dtype), bias, groups=num_channels)[0]
    # The state after n tokens is the K - 1 inputs ending at input n: window columns [n, n+K-1).
    saved = [window[:, n : n + kernel - 1].clone() for n in snapshots]
    return out.t(), window[:, window.shape[1] - (kernel - 1) :].clone(), saved


def conv_step(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d` of one token for each of B requests: `x` `[B, C]`, `conv_state`
    `[B, C, K - 1]`, `weight` `[C, K]`. Returns the output `[B, C]` (no activation) and the new
    states `[B, C, K - 1]`."""
    window = torch.cat([conv_state.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, K]
    out = (window * weight.to(x.dtype)[None]).sum(dim=-1)
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out, window[:, :, 1:].contiguous()


def decode_batch(chunks: Sequence[StateChunk]) -> tuple[list[StateChunk], list[StateChunk]]:
    """(the decodes: chunks of one token whose state is saved after it, to run as one batch;
    every other chunk, to run alone)."""
    decodes: list[StateChunk] = []
    others: list[StateChunk] = []
    for chunk in chunks:
        one = chunk.rows.stop - chunk.rows.start == 1 and chunk.snapshots == (1,)
        (decodes if one else others).append(chunk)
    return decodes, others


def to_chunks(tensors: Iterable[torch.Tensor], chunk_size: int) -> list[torch.Tensor]:
    """Each `[L, H, ...]` tensor zero-padded to N whole chunks and laid out `[N, H, C, ...]`
    (contiguous, so that one chunk's slice is too)."""
    out = []
    for x in tensors:
        pad = (-x.shape[0]) % chunk_size
        padded = F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
        chunks = padded.reshape(padded.shape[0] // chunk_size, chunk_size, *x.shape[1:])
        out.append(chunks.transpose(1, 2).contiguous())
    return out


def decay_within_chunks(cum: torch.Tensor) -> torch.Tensor:
    """`[..., C, C]` with exp(cum_i - cum_j) for j <= i and 0 above the diagonal, from the
    cumulative log decay `cum` `[..., C]` (masked before the exponential, so no overflow)."""
    size = cum.shape[-1]
    causal = torch.ones(size, size, dtype=torch.bool, device=cum.device).tril()
    return (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()


def snapshots_by_chunk(snapshots: tuple[int, ...], chunk_size: int) -> dict[int, list[int]]:
    """Chunk index -> the snapshot offsets j (1..chunk_size) inside it, ascending."""
    out: dict[int, list[int]] = {}
    for count in snapshots:
        out.setdefault((count - 1) // chunk_size, []).append((count - 1) % chunk_size + 1)
    return out


def scan_chunk_size(device: torch.device) -> int:
    """Tokens per chunk of the chunked scans in plain torch: 64 on GPUs (the size the field's
    kernels use), 32 on CPU (measured faster there for both layers at real layer shapes: the
    within-chunk C x C work halves, the per-token state work stays)."""
    return 64 if device.type == "cuda" else 32


# Chunks whose within-chunk terms are computed together: long prefills run in spans of this
# many chunks, so the [chunks, heads, C, C] temporaries stay bounded (and in cache on CPU).
SPAN_CHUNKS = 16

Scan = Callable[
    [slice, torch.Tensor, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]
]


def in_spans(
    scan: Scan, length: int, state: torch.Tensor, *, span: int, snapshots: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """`scan(tokens, state, snapshots)` over consecutive spans of `span` tokens, carrying the
    state: the concatenated outputs, the final state and the states after each snapshot count."""
    outs, saved = [], []
    for start in range(0, length, span):
        end = min(start + span, length)
        local = tuple(count - start for count in snapshots if start < count <= end)
        out, state, states = scan(slice(start, end), state, local)
        outs.append(out)
        saved.extend(states)
    return (outs[0] if len(outs) == 1 else torch.cat(outs)), state, saved
