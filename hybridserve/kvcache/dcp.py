"""Decode-context-parallel geometry: which rank holds which token of a sharded group."""

from __future__ import annotations

from hybridserve.core.errors import ConfigError


def dcp_local_seq_lens(num_tokens: int, *, world_size: int, interleave: int) -> list[int]:
    """Tokens of a length-L sequence held by each rank (SPEC.md 4.1).

    base = floor(L / (I*N)) * I; rank r holds base + clip(L - base*N - r*I, 0, I).
    """
    if world_size < 1 or interleave < 1:
        raise ConfigError(
            "dcp", (world_size, interleave), "world size and interleave must both be >= 1"
        )
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens} is negative")
    base = num_tokens // (interleave * world_size) * interleave
    rest = num_tokens - base * world_size
    return [base + min(max(rest - r * interleave, 0), interleave) for r in range(world_size)]
