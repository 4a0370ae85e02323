"""The rules of update(): which sampled tokens a request keeps, and where next step's drafts go."""

from __future__ import annotations

from collections.abc import Mapping

from hybridserve.core.plan import ScheduledChunk
from hybridserve.core.request import Request, RequestStatus, keep_sampled

__all__ = ["keep_drafts", "keep_sampled"]


def keep_drafts(
    chunks: tuple[ScheduledChunk, ...],
    requests: Mapping[str, Request],
    drafts: Mapping[str, tuple[int, ...]],
    limit: int,
) -> None:
    """Store the drafts (at most `limit` each) for the next step of requests that sampled this
    step and still run (vLLM's `update_draft_token_ids`: a partial prefill chunk drops them)."""
    for chunk in chunks:
        proposed = drafts.get(chunk.req_id)
        if not proposed or not chunk.sample:
            continue
        request = requests.get(chunk.req_id)
        if request is not None and request.status is RequestStatus.RUNNING:
            request.draft_token_ids[:] = proposed[:limit]
