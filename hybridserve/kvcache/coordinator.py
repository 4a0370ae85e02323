"""Hybrid reconciliation: the largest L <= cap, a multiple of A, that every group can serve.

A fixed point: every group is asked about the current candidate; the candidate falls to the
lowest answer; groups that already accepted a candidate are not asked again about it. Each pass
evaluates all groups at the same candidate, so the result does not depend on group order, and
the first pass (at the cap) gives each group's offered hit with no second evaluation. The
candidate strictly decreases, so the loop terminates.

A tail-dropping group (an EAGLE group on the legacy path) is asked with a margin,
`min(cand + margin, reach)`, and drops that margin from what it finds, so it lands back on
`cand` when it can: its drop is applied once per candidate and the EAGLE spiral cannot happen
(SPEC.md 3.3). The margin is what the group drops: one A for full attention, one block of its
own for a sliding window (vLLM's `eagle_margin`, the group's block size).
`reach` is the hashed length of the request in a hybrid layout (vLLM's hybrid coordinator asks
with `min(candidate + eagle_margin, len(block_hashes) * hash_block_size)`) and the cap in a
single-group one (vLLM's unitary coordinator).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridserve.kvcache.groups import GroupLookup


@dataclass(frozen=True, slots=True)
class Reconciliation:
    num_tokens: int  # the reconciled hit
    offered: tuple[int, ...]  # per group, its answer at the cap (first pass)
    limiting_group: int | None  # the group that set the final length; None if the cap did
    num_passes: int


def reconcile(
    lookups: Sequence[GroupLookup],
    drops: Sequence[bool],
    *,
    alignment: int,
    cap: int,
    reach: int | None = None,
    margins: Sequence[int] | None = None,
) -> Reconciliation:
    cand = max(cap, 0) // alignment * alignment
    top = cap if reach is None else max(reach, cap)
    accepted: list[int | None] = [None] * len(lookups)
    offered: tuple[int, ...] | None = None
    limiting: int | None = None
    passes = 0
    while True:
        passes += 1
        answers = []
        for g, lookup in enumerate(lookups):
            if accepted[g] == cand:
                answers.append(cand)
                continue
            margin = alignment if margins is None else margins[g]
            limit = min(cand + margin, top) if drops[g] else cand
            answers.append(min(lookup.serve(limit, drops[g]), cand))
        if offered is None:
            offered = tuple(answers)
        lowest = min(answers)
        if lowest == cand:
            break
        limiting = answers.index(lowest)
        accepted = [lowest if answer == lowest else None for answer in answers]
        cand = lowest
        if cand == 0:
            break
    return Reconciliation(cand, offered, limiting, passes)
