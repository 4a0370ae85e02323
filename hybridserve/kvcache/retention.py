"""Which checkpoints of state-like groups (Mamba, SWA, draft) are registered in the cache.

Positions are computed in the alignment unit A, never in a group's block size or the page P
(SPEC.md 3.5). A *reachable boundary* B is a position a future lookup can land on: the replay
boundary `prompt_len - 1`, or a shared-prefix junction found at admission.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from hybridserve.core.errors import ConfigError


class RetentionKind(StrEnum):
    DENSE = "dense"
    BOUNDARY = "boundary"
    BOUNDARY_ONLY = "boundary-only"
    BOUNDARY_PREDECESSOR = "boundary+predecessor"
    INTERVAL = "interval"


@dataclass(frozen=True, slots=True)
class Retention:
    """Which Mamba states a request keeps. `interval` keeps one checkpoint per N tokens plus the
    landing set."""

    kind: RetentionKind = RetentionKind.BOUNDARY_PREDECESSOR
    interval_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind is RetentionKind.INTERVAL and self.interval_tokens < 1:
            raise ConfigError(
                "retention", f"interval:{self.interval_tokens}", "use interval:N with N >= 1"
            )
        if self.kind is not RetentionKind.INTERVAL and self.interval_tokens != 0:
            raise ConfigError(
                "retention.interval_tokens", self.interval_tokens, "only interval:N takes N"
            )

    @classmethod
    def parse(cls, text: str) -> Retention:
        """Parse `dense`, `boundary`, `boundary-only`, `boundary+predecessor` or `interval:N`."""
        value = text.strip().lower()
        match = re.fullmatch(r"interval:(\d+)", value)
        if match:
            return cls(RetentionKind.INTERVAL, int(match.group(1)))
        for kind in (
            RetentionKind.DENSE,
            RetentionKind.BOUNDARY,
            RetentionKind.BOUNDARY_ONLY,
            RetentionKind.BOUNDARY_PREDECESSOR,
        ):
            if value == kind.value:
                return cls(kind)
        raise ConfigError(
            "retention",
            text,
            "use dense, boundary, boundary-only, boundary+predecessor or interval:N",
        )

    @property
    def name(self) -> str:
        if self.kind is RetentionKind.INTERVAL:
            return f"interval:{self.interval_tokens}"
        return str(self.kind.value)

    @property
    def is_dense(self) -> bool:
        return self.kind is RetentionKind.DENSE

    def landing_positions(
        self,
        boundary: int,
        *,
        alignment: int,
        drops_target_tail: bool,
        sharded_units: tuple[int, ...],
    ) -> Landing:
        """Where lookups limited by one reachable boundary B can land.

        The target's full-attention lookup of a request sharing B or B+1 tokens matches
        floor(n/U)*U tokens (U = A, or a DCP-sharded unit) and then drops one A under a
        tail-dropping method: those are the `window` positions that attention-window groups
        (SWA, draft) keep. State groups keep them plus floor(B/A)*A itself (the boundary and
        its predecessor). The `boundary` retention is vLLM 0.33's `replay_boundaries`: floor(B/A)*A,
        or under the legacy EAGLE drop the dropped landings of B and B + 1; `interval:N` keeps
        the same landings (its multiples of N are kept apart, in the mask). `boundary-only` is
        the pre-0.33 rule: floor(B/A)*A alone, whatever the drop.
        """
        base = boundary // alignment * alignment
        drop = alignment if drops_target_tail else 0
        if self.kind is RetentionKind.BOUNDARY_ONLY:
            # Pre-0.33 vLLM: floor(B/A)*A (and its coarser full-attention landings) whatever
            # the drop, so a dropped lookup finds no state (the collapsed common hit).
            kept = {base, *(boundary // unit * unit for unit in sharded_units)}
            only = tuple(sorted(p for p in kept if p > 0))
            return Landing(state=only, window=only)
        if self.kind in (RetentionKind.BOUNDARY, RetentionKind.INTERVAL):
            # vLLM's replay_boundaries: the boundary itself, and where a full-attention lookup
            # coarser than A lands on it; under the legacy EAGLE drop, where the dropped lookup
            # of a request sharing B or B + 1 tokens lands.
            ends = (boundary, boundary + 1) if drop else (boundary,)
            kept = {n // unit * unit - drop for unit in (alignment, *sharded_units) for n in ends}
            only = tuple(sorted(p for p in kept if p > 0))
            if not drop:
                return Landing(state=only, window=only)
            # vLLM clamps a dropped landing below A to 0: no state there, but a dropping window
            # group still keeps the block after it (block 0, its lookup's proof).
            return Landing(state=only, window=tuple(sorted({max(p, 0) for p in kept})))
        window = {
            n // unit * unit - drop
            for unit in (alignment, *sharded_units)
            for n in (boundary, boundary + 1)
        }
        window = {p for p in window if p > 0}
        state = {p for p in window | {base} if p > 0}
        return Landing(state=tuple(sorted(state)), window=tuple(sorted(window)))


@dataclass(frozen=True, slots=True)
class Landing:
    """Positions to keep for one boundary: state snapshots, and window-group landings."""

    state: tuple[int, ...]
    window: tuple[int, ...]
