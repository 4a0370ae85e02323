"""Cache group specs: one frozen description per kind of layer group."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from hybridserve.core.errors import ConfigError


class GroupKind(StrEnum):
    FULL = "full"
    MLA = "mla"
    SWA = "swa"
    CHUNKED_LOCAL = "chunked_local"
    MAMBA = "mamba"
    DRAFT = "draft"


class MambaCacheMode(StrEnum):
    ALL = "all"  # a state at every block end
    ALIGN = "align"  # a state only where a scheduled chunk ends on the block grid


@dataclass(frozen=True, kw_only=True, slots=True)
class FullAttentionSpec:
    """Full attention (or MLA with `mla=True`). Sharded over DCP ranks by token."""

    block_size: int
    mla: bool = False

    def __post_init__(self) -> None:
        _check_block_size("full.block_size", self.block_size)

    @property
    def kind(self) -> GroupKind:
        return GroupKind.MLA if self.mla else GroupKind.FULL

    @property
    def dcp_sharded(self) -> bool:
        return True


@dataclass(frozen=True, kw_only=True, slots=True)
class SlidingWindowSpec:
    """Sliding-window attention: a resume at L needs the previous `window - 1` tokens."""

    block_size: int
    window: int

    def __post_init__(self) -> None:
        _check_block_size("swa.block_size", self.block_size)
        if self.window < 1:
            raise ConfigError("swa.window", self.window, "use a window of at least 1 token")

    @property
    def kind(self) -> GroupKind:
        return GroupKind.SWA

    @property
    def dcp_sharded(self) -> bool:
        return False

    @property
    def lookback_tokens(self) -> int:
        """Tokens before a resume position whose KV must be cached."""
        return self.window - 1


@dataclass(frozen=True, kw_only=True, slots=True)
class DraftSpec:
    """A drafter's own sliding-window KV (DFlash/DSpark). Replicated under DCP (width 1).

    `extra_tokens` are retained before the window (the drafter reads them as context).
    The group never receives the target-tail drop.
    """

    block_size: int
    window: int
    extra_tokens: int = 0

    def __post_init__(self) -> None:
        _check_block_size("draft.block_size", self.block_size)
        if self.window < 1:
            raise ConfigError("draft.window", self.window, "use a window of at least 1 token")
        if self.extra_tokens < 0:
            raise ConfigError("draft.extra_tokens", self.extra_tokens, "use 0 or more tokens")

    @property
    def kind(self) -> GroupKind:
        return GroupKind.DRAFT

    @property
    def dcp_sharded(self) -> bool:
        return False

    @property
    def lookback_tokens(self) -> int:
        return self.window - 1 + self.extra_tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkedLocalSpec:
    """Chunked local attention: tokens attend only within their `chunk`-aligned chunk."""

    block_size: int
    chunk: int

    def __post_init__(self) -> None:
        _check_block_size("chunked_local.block_size", self.block_size)
        if self.chunk < 1 or self.chunk % self.block_size != 0:
            raise ConfigError(
                "chunked_local.chunk",
                self.chunk,
                f"use a positive multiple of block_size={self.block_size}",
            )

    @property
    def kind(self) -> GroupKind:
        return GroupKind.CHUNKED_LOCAL

    @property
    def dcp_sharded(self) -> bool:
        return False


@dataclass(frozen=True, kw_only=True, slots=True)
class MambaSpec:
    """Mamba2 / gated-delta-net recurrent state: one state snapshot per block end."""

    block_size: int
    mode: MambaCacheMode = MambaCacheMode.ALIGN
    # Align mode: a prefill chunk that starts on the block grid and ends inside a block also
    # writes the state at its last block boundary into a checkpoint block, so the chunk need
    # not stop there (vLLM's num_prefill_checkpoint_blocks=1).
    prefill_checkpoint: bool = False
    # Align mode with speculative decoding: blocks right after the running state block that hold
    # the draft tokens' states (vLLM's MambaSpec.num_speculative_blocks). 0 = the lookahead
    # slots decide, one scratch block per block they reach.
    num_speculative_blocks: int = 0

    def __post_init__(self) -> None:
        _check_block_size("mamba.block_size", self.block_size)
        if (
            isinstance(self.num_speculative_blocks, bool)
            or not isinstance(self.num_speculative_blocks, int)
            or self.num_speculative_blocks < 0
        ):
            raise ConfigError(
                "mamba.num_speculative_blocks", self.num_speculative_blocks, "use 0 or more"
            )
        if not isinstance(self.mode, MambaCacheMode):
            raise ConfigError("mamba.mode", self.mode, "use 'all' or 'align'")

    @property
    def kind(self) -> GroupKind:
        return GroupKind.MAMBA

    @property
    def dcp_sharded(self) -> bool:
        return False


GroupSpec = FullAttentionSpec | SlidingWindowSpec | DraftSpec | ChunkedLocalSpec | MambaSpec


def _check_block_size(field: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field, value, "use a positive number of tokens per block")


def state_quantum(groups: tuple[GroupSpec, ...]) -> int:
    """The control quantum q (SPEC.md 5.2): the largest state-group block size, 1 without one."""
    return max((g.block_size for g in groups if g.kind is GroupKind.MAMBA), default=1)
