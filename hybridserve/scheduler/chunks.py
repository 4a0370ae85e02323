"""The end of schedule(): every scheduled request's tokens become its chunk of the step plan."""

from __future__ import annotations

from typing import NamedTuple

from hybridserve.core.plan import ScheduledChunk
from hybridserve.core.request import Request
from hybridserve.kvcache import KVCacheManager
from hybridserve.scheduler.step import StepState


class ChunkTally(NamedTuple):
    """The step's chunks in scheduling order, and its token counts."""

    chunks: tuple[ScheduledChunk, ...]
    num_prefill_tokens: int  # tokens of chunks that start before their request's prefill end
    num_decode_tokens: int
    kv_tokens_read: int  # context tokens the step attends over (the sum of chunk ends)
    decode_kv_tokens: int  # the same over decode chunks only
    prefill_pairs: int  # (query, key) pairs the prefill chunks attend (causal)
    max_prefill_start: int  # the longest context a prefill chunk starts at


def cut_chunks(step: StepState, requests: dict[str, Request], cache: KVCacheManager) -> ChunkTally:
    """Advance each scheduled request's computed tokens by its share of the step and cut its
    chunk: its tokens (drafts last), its new blocks (all of them for an admission) and whether
    it samples (it reaches its last token). Every scheduled request uses up its drafts."""
    chunks = []
    num_prefill = num_decode = kv_read = decode_kv = pairs = longest = 0
    admitted, allocations = step.admitted, step.allocations
    for req_id, num_new in step.scheduled.items():
        request = requests[req_id]
        start = request.num_computed_tokens
        end = start + num_new
        request.num_computed_tokens = end
        token_ids = request.token_ids
        num_tokens = len(token_ids)
        kv_read += end
        if end <= num_tokens:
            num_draft = 0
            tokens = (token_ids[start],) if num_new == 1 else tuple(token_ids[start:end])
        else:
            num_draft = end - num_tokens
            tokens = (*token_ids[start:], *request.draft_token_ids[:num_draft])
        if request.draft_token_ids:
            request.draft_token_ids.clear()
        if start < request.prefill_end:
            num_prefill += num_new
            pairs += num_new * start + num_new * (num_new + 1) // 2
            longest = max(longest, start)
        else:
            num_decode += num_new
            decode_kv += end
        sample = end - num_draft >= num_tokens
        if req_id in admitted:
            block_ids = cache.block_ids(req_id)
            chunks.append(
                ScheduledChunk(
                    req_id, start, tokens, block_ids, sample, num_draft, True, request.sampling
                )
            )
        else:
            block_ids = allocations[req_id].new_block_ids
            chunks.append(ScheduledChunk(req_id, start, tokens, block_ids, sample, num_draft))
    return ChunkTally(
        tuple(chunks),
        num_prefill,
        num_decode,
        kv_read,
        decode_kv,
        pairs,
        longest,
    )
