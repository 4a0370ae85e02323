"""A deterministic fake executor: tokens from a function, a fixed step duration."""

from __future__ import annotations

from collections.abc import Callable

from hybridserve.core.plan import StepPlan, StepResult

TokenFn = Callable[[str, int], int]


class FakeExecutor:
    """Samples `token_fn(req_id, t)` for the t-th output token of each sampling chunk.

    Draft tokens are all rejected (only the bonus token is emitted). Output counts survive a
    preemption, as the request's outputs do.
    """

    def __init__(self, token_fn: TokenFn, *, step_duration_s: float = 0.0) -> None:
        self.token_fn = token_fn
        self.step_duration_s = step_duration_s
        self._num_outputs: dict[str, int] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for req_id in plan.finished_req_ids:
            self._num_outputs.pop(req_id, None)
        sampled: dict[str, tuple[int, ...]] = {}
        for chunk in plan.chunks:
            if not chunk.sample:
                continue
            t = self._num_outputs.get(chunk.req_id, 0)
            sampled[chunk.req_id] = (self.token_fn(chunk.req_id, t),)
            self._num_outputs[chunk.req_id] = t + 1
        return StepResult(plan.step_id, sampled, self.step_duration_s)
