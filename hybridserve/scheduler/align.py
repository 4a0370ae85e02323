"""Prefill chunk splitting for align-mode state groups: chunks end where states must exist."""

from __future__ import annotations

from hybridserve.core.config import SchedulerConfig
from hybridserve.core.request import Request
from hybridserve.kvcache import KVCacheManager
from hybridserve.kvcache.retention import RetentionKind
from hybridserve.kvcache.spec import MambaCacheMode, MambaSpec


def align_block_size(cache: KVCacheManager) -> int:
    """Block size of align-mode state groups (prefill chunks end on its grid), or 0."""
    sizes = [
        s.block_size
        for s in cache.layout.groups
        if isinstance(s, MambaSpec) and s.mode is MambaCacheMode.ALIGN
    ]
    return max(sizes) if sizes else 0


class AlignSplitter:
    """Cuts prefill chunks so that the states future lookups need get materialised.

    Non-final chunks end on the state block grid. A chunk stops at the sequence's last block
    boundary (one block earlier under a tail-dropping method) unless it starts on the grid and
    a prefill checkpoint block will hold that state, and it stops at a shared-prefix junction.
    Predecessor retention (not vLLM's) adds its own checkpoint positions as stops.
    """

    def __init__(self, config: SchedulerConfig, cache: KVCacheManager) -> None:
        self.cache = cache
        self.block = align_block_size(cache)
        self.drops_tail = cache.layout.speculative.drops_target_tail
        # The final chunk's checkpoint block holds the last boundary's state (one block lower
        # under the legacy EAGLE drop).
        self.prefill_checkpoint = any(
            isinstance(s, MambaSpec) and s.prefill_checkpoint for s in cache.layout.groups
        )
        threshold = config.long_prefill_token_threshold
        budget = config.max_num_batched_tokens
        self.max_prefill_chunk = min(budget, threshold) if threshold > 0 else budget
        # vLLM's split never reads the retention (dense and interval retention included);
        # only our predecessor retention adds the stops that materialise its extra states.
        self.vllm_stops_only = cache.layout.retention.kind is not RetentionKind.BOUNDARY_PREDECESSOR
        # Fine-grained hits (vLLM's mamba_partial_cache_hit): the prompt's last hash boundary
        # inside a state block must hold a state too.
        self.hash_unit = cache.layout.hash_block_size
        self.partial_tail = cache.layout.partial_hash_hits and self.hash_unit < self.block

    def split(self, request: Request, num_new: int, *, hit: int, junction: int) -> int:
        start = request.num_computed_tokens + hit
        prefill_end = request.prefill_end
        if start >= prefill_end:
            return num_new  # decode
        block = self.block
        end = start + num_new
        last_cache = request.num_tokens - request.num_tokens % block
        if self.drops_tail:
            last_cache = max(last_cache - block, 0)
        if self.prefill_checkpoint and start % block == 0:
            last_cache = 0
        if end < prefill_end:
            aligned_end = end // block * block
            if aligned_end > start or block <= self.max_prefill_chunk:
                end = aligned_end
        stops = [last_cache]
        if self.partial_tail:
            # tail_boundary: a checkpoint holds it when the chunk starts on the grid and spans a
            # block; otherwise the chunk ends there.
            tail = (request.num_tokens - 1) // self.hash_unit * self.hash_unit
            covered = self.prefill_checkpoint and start % block == 0 and end - start >= block
            if not covered:
                stops.append(tail)
        if start % block:
            stops.append((start // block + 1) * block)
        if start < junction < end:
            stops.append(start + (junction - start) // block * block)
        stops.extend(self._retention_stops(request))
        end = min([end, *(s for s in stops if start < s < end)])
        return max(end - start, 0)

    def _retention_stops(self, request: Request) -> tuple[int, ...]:
        if self.vllm_stops_only:
            return ()  # exactly vLLM's forced chunk ends
        return self.cache.checkpoint_positions(request.req_id) or self.cache.planned_checkpoints(
            request.num_prompt_tokens, None
        )
