"""The rules of update(): which sampled tokens a request keeps, and where next step's drafts go."""

from __future__ import annotations

from collections.abc import Mapping

from hybridserve.core.plan import ScheduledChunk
from hybridserve.core.request import Request, RequestStatus, SamplingParams


def keep_sampled(
    sampling: SamplingParams, num_output_tokens: int, sampled: tuple[int, ...]
) -> tuple[tuple[int, ...] | list[int], RequestStatus | None]:
    """The tokens of `sampled` a request with `num_output_tokens` outputs keeps, in order, and
    the status it finishes with (None: it keeps running): a stop token is kept and ends it, as
    does reaching max_tokens; tokens after either are dropped."""
    stop_ids = () if sampling.ignore_eos else sampling.stop_token_ids
    room = sampling.max_tokens - num_output_tokens
    if len(sampled) == 1 and not stop_ids and room > 1:
        return sampled, None  # the common decode: nothing to check
    kept: list[int] = []
    for token in sampled:
        kept.append(token)
        if token in stop_ids:
            return kept, RequestStatus.FINISHED_STOPPED
        if len(kept) >= room:
            return kept, RequestStatus.FINISHED_LENGTH
    return kept, None


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
            request.spec_token_ids[:] = proposed[:limit]
