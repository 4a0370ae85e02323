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

from hybridserve.executor.torch import cpu_kernels

if TYPE_CHECKING:
    from hybridserve.executor.torch.forward import StateChunk

State = dict[str, torch.Tensor]

# Chunks of at most this many tokens run the token loop, longer ones the chunked scan: where the
# loop was faster at real layer shapes on CPU (`benchmarks/recurrent_prefill.py --threshold`
# times both at lengths 1..16). The loops advance their state in place: the gated delta rule's
# wins up to 3 tokens at Qwen3-Next's shape (1 thread: 0.29 against 0.82 ms at 1 token, 0.86
# against 1.13 at 3, 0.99 against 0.69 at 4), Mamba2's up to 2 at Nemotron-H's (2 threads: 0.31
# against 0.46 ms at 1 token, 0.52 against 0.58 at 2, 0.78 against 0.58 at 3; 1 thread ties at 3).
GATED_DELTA_LOOP_MAX_TOKENS = 3
MAMBA2_LOOP_MAX_TOKENS = 2


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


def pad_to_chunks(tensors: Iterable[torch.Tensor], chunk_size: int) -> list[torch.Tensor]:
    """Each `[L, ...]` tensor zero-padded to whole chunks of `chunk_size` tokens, still token
    major (no copy when L already is whole chunks)."""
    out = []
    for x in tensors:
        pad = (-x.shape[0]) % chunk_size
        out.append(F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) if pad else x)
    return out


# A decay below exp(LOG_DECAY_FLOOR) is exactly zero. exp(-60) ~ 8.8e-27: against the term a
# token writes with decay 1 its part is below float32's resolution by 19 orders of magnitude, so
# zero changes no sum the scans form beyond rounding. Flooring (exp(-80) kept as it was) was not
# enough: its products with small inputs underflow to subnormal floats, on which an x86 CPU
# takes a slow path for every operation (a 256-token prefill of a Mamba2 hybrid whose decays
# reach -100 a token ran 2.8x slower with them). The exponential of numbers below the floor is
# never computed (it too underflows to subnormals, 6x slower).
LOG_DECAY_FLOOR = -60.0


def decay_exp(log_decay: torch.Tensor) -> torch.Tensor:
    """exp of a log decay (<= 0), exactly 0 below `LOG_DECAY_FLOOR`."""
    below = log_decay < LOG_DECAY_FLOOR
    return log_decay.clamp(min=LOG_DECAY_FLOOR).exp_().masked_fill_(below, 0.0)


def decay_within_chunks(cum: torch.Tensor) -> torch.Tensor:
    """`[..., C, C]` with exp(cum_i - cum_j) for j <= i (exactly 0 below `LOG_DECAY_FLOOR`) and
    exactly 0 above the diagonal, from the cumulative log decay `cum` `[..., C]`
    (non-increasing, so the upper triangle's differences, clamped to 0 before the
    exponential, cannot overflow)."""
    diff = cum[..., :, None] - cum[..., None, :]
    below = diff < LOG_DECAY_FLOOR
    return diff.clamp_(LOG_DECAY_FLOOR, 0.0).exp_().masked_fill_(below, 0.0).tril_()


def snapshots_by_chunk(snapshots: tuple[int, ...], chunk_size: int) -> dict[int, list[int]]:
    """Chunk index -> the snapshot offsets j (1..chunk_size) inside it, ascending."""
    out: dict[int, list[int]] = {}
    for count in snapshots:
        out.setdefault((count - 1) // chunk_size, []).append((count - 1) % chunk_size + 1)
    return out


# Tokens per chunk of the chunked scans' C kernels (gated_delta_chunked.c, ssd_chunked.c): their
# per-chunk costs are small and the C x C work grows with the chunk. On the Intel Xeon host at
# real layer shapes (4,096 tokens, 2 threads): the gated delta rule 70-73 ms at 16, 72-74 at 24,
# 79-82 at 32, 76 at 8; the SSD scan 95-105 ms at 16 and at 32, 111-120 at 64.
KERNEL_CHUNK_SIZE = 16


def scan_chunk_size(device: torch.device) -> int:
    """Tokens per chunk of the chunked scans in plain torch: 64 on GPUs (the size the field's
    kernels use), 32 on CPU (measured faster there for both layers at real layer shapes: the
    within-chunk C x C work halves, the per-token state work stays)."""
    return 64 if device.type == "cuda" else 32


ScanResult = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]


def kernel_scan(
    run: Callable[[cpu_kernels.CpuKernels, int], ScanResult | None],
    tensors: Sequence[torch.Tensor],
    chunk_size: int | None,
) -> ScanResult | None:
    """A chunked scan by its C kernel (`run(kernels, chunk size)`; `tensors[0]` token-major),
    or None where the torch form must run: not a CPU, kernels off or not built, autograd on
    an input, or `run` declines the shapes. `chunk_size` None: KERNEL_CHUNK_SIZE."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    kernels = cpu_kernels.for_tensor(tensors[0])
    if kernels is None:
        return None
    size = KERNEL_CHUNK_SIZE if chunk_size is None else chunk_size
    return run(kernels, max(1, min(size, tensors[0].shape[0])))


def torch_chunk_size(device: torch.device, length: int, chunk_size: int | None) -> int:
    """The torch form's tokens per chunk: `chunk_size`, or the device's (scan_chunk_size),
    within [1, length]."""
    return max(1, min(scan_chunk_size(device) if chunk_size is None else chunk_size, length))


# Chunks whose within-chunk terms are computed together: long prefills run in spans of this
# many chunks, so the [chunks, heads, C, C] temporaries stay bounded (and in cache on CPU).
SPAN_CHUNKS = 16

Scan = Callable[[slice, torch.Tensor, tuple[int, ...], torch.Tensor], list[torch.Tensor]]


def in_spans(
    scan: Scan,
    like: torch.Tensor,
    state: torch.Tensor,
    *,
    chunk_size: int,
    snapshots: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """`scan(tokens, state, snapshots, out)` over consecutive spans of `SPAN_CHUNKS` chunks of a
    request's tokens: each span writes its outputs into `out` (its rows of one buffer shaped like
    `like` `[L, ...]`, padded to whole chunks), advances `state` (a private copy) in place and
    returns the states after its snapshot counts. Returns the outputs, the final state and the
    snapshots."""
    length = like.shape[0]
    out = like.new_empty(length + (-length) % chunk_size, *like.shape[1:])
    state = state.clone()
    saved: list[torch.Tensor] = []
    span = chunk_size * SPAN_CHUNKS
    for start in range(0, length, span):
        end = min(start + span, length)
        local = tuple(count - start for count in snapshots if start < count <= end)
        rows = slice(start, start + end - start + (start - end) % chunk_size)
        saved.extend(scan(slice(start, end), state, local, out[rows]))
    return out[:length], state, saved
