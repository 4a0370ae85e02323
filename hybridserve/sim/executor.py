"""SimulatedExecutor: synthetic tokens from seeded RNGs, step durations from a cost function.

Speculative decoding is modelled by capability: each decode proposes `num_speculative_tokens`
drafts for the next step, and each draft position is accepted with probability
`acceptance_rate` until the first rejection; the step emits the accepted drafts plus the bonus
token, so one step can deliver several tokens.

The acceptance rate is a constant by default. Published MTP figures bracket the default 0.7:
vLLM pull request #48892 logs a per-position acceptance of 83.4% for one MTP draft (gsm8k,
greedy) and 76.2%, 61.6%, 51.3%, ... for eight; a teacher-forced measurement of a Qwen3-family
MTP head (tenstorrent/vllm issue #442) gives 0.91 on code, 0.49 on prose, 0.647 pooled. No
published curve of acceptance against context length was found (sglang issue #30763 reports a
fall to 0.19 past 32K tokens on Qwen3.5, as a bug), so the fall with context is an option,
`acceptance_decay_per_doubling`: p(c) = max(0, p - d * log2(max(c, 1024) / 1024)).

Each request draws from its own stream (seeded by the run's seed and the request id), so two
configurations that batch the same request differently still accept the same drafts for it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from hybridserve.core.plan import StepPlan, StepResult

StepTime = Callable[[StepPlan], float]
_DECAY_FROM_TOKENS = 1024


class SimulatedExecutor:
    def __init__(
        self,
        step_time: StepTime,
        *,
        seed: int = 0,
        vocab_size: int = 151_936,
        num_speculative_tokens: int = 0,
        acceptance_rate: float = 0.0,
        acceptance_decay_per_doubling: float = 0.0,
    ) -> None:
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate={acceptance_rate}; use a value in [0, 1]")
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens}; use >= 0")
        if not 0.0 <= acceptance_decay_per_doubling <= 1.0:
            raise ValueError(
                f"acceptance_decay_per_doubling={acceptance_decay_per_doubling}; use [0, 1]"
            )
        self.step_time = step_time
        self.seed = seed
        self.vocab_size = vocab_size
        self.num_speculative_tokens = num_speculative_tokens
        self.acceptance_rate = acceptance_rate
        self.acceptance_decay_per_doubling = acceptance_decay_per_doubling
        self._streams: dict[str, random.Random] = {}

    def acceptance_at(self, context_tokens: int) -> float:
        """The per-draft acceptance probability at `context_tokens` of context."""
        if self.acceptance_decay_per_doubling == 0.0:
            return self.acceptance_rate
        doublings = math.log2(max(context_tokens, _DECAY_FROM_TOKENS) / _DECAY_FROM_TOKENS)
        return max(0.0, self.acceptance_rate - self.acceptance_decay_per_doubling * doublings)

    def _stream(self, req_id: str) -> random.Random:
        rng = self._streams.get(req_id)
        if rng is None:
            rng = self._streams[req_id] = random.Random(f"{self.seed}/{req_id}")
        return rng

    def execute(self, plan: StepPlan) -> StepResult:
        for req_id in plan.finished_req_ids:
            self._streams.pop(req_id, None)
        sampled: dict[str, tuple[int, ...]] = {}
        drafts: dict[str, tuple[int, ...]] = {}
        vocab, k = self.vocab_size, self.num_speculative_tokens
        for chunk in plan.chunks:
            if not chunk.sample:
                continue
            rng = self._stream(chunk.req_id)
            accepted = 0
            if chunk.num_draft_tokens:
                # Placeholder drafts (-1, padding of a one-token admission) are never accepted.
                drafted = chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens :]
                num_real = sum(1 for t in drafted if t >= 0)
                p = self.acceptance_at(chunk.start + len(chunk.token_ids))
                while accepted < num_real and rng.random() < p:
                    accepted += 1
            token = int(rng.random() * vocab)
            if accepted:
                draft_ids = chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens :]
                sampled[chunk.req_id] = (*draft_ids[:accepted], token)
            else:
                sampled[chunk.req_id] = (token,)
            if k:
                # Draft values never matter to the simulation, only how many are accepted.
                drafts[chunk.req_id] = (token,) * k
        return StepResult(plan.step_id, sampled, self.step_time(plan), drafts)
