"""Synthetic token ids onto a server's vocabulary, and the synthetic answers a job appends.

The agent workload draws token ids from ranges far above any vocabulary (each agent's fresh
tokens in a range of its own, the shared system prompt from 0). `TokenMap` sends each id to
`splitmix64(id) mod vocab_size`, so equal ids stay equal (shared prefixes stay shared) and the
prompt is valid on any server whose vocabulary holds `vocab_size` ids.

By default the answer a job appends to its history is not the server's output but synthetic
tokens of the drawn answer length (`SyntheticAnswers`, negative ids: they collide with no prompt
token): the request sequence of a seed is then the same on every server, whatever tokens it
generates. The price: a server cannot reuse the cache of the answer it generated (the next
prompt holds other tokens there), so each turn recomputes its previous answer. With
`--answers server` the job appends what the server generated, as a real agent does (`echoed`:
ids at or below ECHO_BASE, which `TokenMap` sends back to themselves), so a server's cache of
its own answer, and of a turn's exact end, is used; two servers on one seed then see the same
sequence only where they generate the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridserve.core.errors import ConfigError
from hybridserve.sim.workload import SyntheticAnswers

__all__ = ["ECHO_BASE", "SyntheticAnswers", "TokenMap", "echoed"]

_MASK = (1 << 64) - 1
# A server's own token id t rides in a job's history as ECHO_BASE - t: below every synthetic
# id (prompt tokens are >= 0, synthetic answers above -(2^62)).
ECHO_BASE = -(1 << 62)


def echoed(server_ids: Sequence[int]) -> list[int]:
    """A server's generated ids as history ids that `TokenMap.map` sends back to themselves."""
    return [ECHO_BASE - t for t in server_ids]


def _mix(value: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers with good avalanche."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class TokenMap:
    """Synthetic ids -> ids in [0, vocab_size), deterministic; the shared system prompt is
    mapped once."""

    def __init__(self, vocab_size: int, system_prompt: Sequence[int] = ()) -> None:
        if vocab_size < 2:
            raise ConfigError("--vocab-size", vocab_size, "use 2 or more token ids")
        self.vocab_size = vocab_size
        self._system = self.map(system_prompt)

    def map(self, ids: Sequence[int]) -> list[int]:
        vocab = self.vocab_size
        return [ECHO_BASE - t if t <= ECHO_BASE else _mix(t & _MASK) % vocab for t in ids]

    def extend(self, mapped: list[int], history: Sequence[int]) -> list[int]:
        """Bring `mapped` (a mapped prefix of `history`, possibly empty) up to `history`:
        histories only grow, so only the new tail is mapped. Returns `mapped`."""
        if not mapped and len(history) >= len(self._system):
            mapped.extend(self._system)
        mapped.extend(self.map(history[len(mapped) :]))
        return mapped
