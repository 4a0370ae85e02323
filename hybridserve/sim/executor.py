"""SimulatedExecutor: synthetic tokens from a seeded RNG, step durations from a cost function.

Speculative decoding is modelled by capability: each decode proposes `num_speculative_tokens`
drafts for the next step, and each draft position is accepted with probability
`acceptance_rate` until the first rejection; the step emits the accepted drafts plus the bonus
token, so one step can deliver several tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from hybridserve.core.plan import StepPlan, StepResult

StepTime = Callable[[StepPlan], float]


class SimulatedExecutor:
    def __init__(
        self,
        step_time: StepTime,
        *,
        seed: int = 0,
        vocab_size: int = 151_936,
        num_speculative_tokens: int = 0,
        acceptance_rate: float = 0.0,
    ) -> None:
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate={acceptance_rate}; use a value in [0, 1]")
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens}; use >= 0")
        self.step_time = step_time
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size
        self.num_speculative_tokens = num_speculative_tokens
        self.acceptance_rate = acceptance_rate

    def execute(self, plan: StepPlan) -> StepResult:
        sampled: dict[str, tuple[int, ...]] = {}
        drafts: dict[str, tuple[int, ...]] = {}
        rng, vocab, k = self.rng, self.vocab_size, self.num_speculative_tokens
        for chunk in plan.chunks:
            if not chunk.sample:
                continue
            # Placeholder drafts (-1, padding of a one-token admission) are never accepted.
            num_real = sum(
                1
                for t in chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens :]
                if t >= 0
            )
            accepted = 0
            while accepted < num_real and rng.random() < self.acceptance_rate:
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
