"""N-gram (prompt lookup) drafting: propose the tokens that followed the latest earlier
occurrence of the context's last n tokens."""

from __future__ import annotations

from collections.abc import Sequence


def ngram_propose(
    tokens: Sequence[int], *, num_tokens: int, max_n: int = 4, min_n: int = 1
) -> tuple[int, ...]:
    """Up to `num_tokens` drafts, longest matching suffix first; () when nothing matches."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n :])
        # Scan right to left for the latest earlier occurrence of the suffix.
        for start in range(length - n - 1, -1, -1):
            if list(tokens[start : start + n]) == suffix:
                follow = tokens[start + n : start + n + num_tokens]
                if follow:
                    return tuple(follow)
    return ()
