"""What one schedule() decided: the executor's plan plus the scheduler's own record."""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.core.plan import StepPlan


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    plan: StepPlan
    # (req_id, tokens) in vLLM's order: scheduled running requests, then admissions.
    num_scheduled_tokens: tuple[tuple[str, int], ...]
    new_reqs: tuple[tuple[str, int], ...]  # first admissions: (req_id, prefix-hit tokens)
    resumed: tuple[tuple[str, int], ...]  # re-admissions after preemption: (req_id, hit)
    preempted: tuple[str, ...]  # in the order they were preempted
    finished_req_ids: tuple[str, ...]  # finished in the previous step's update
    num_free_blocks: int  # right after scheduling
    num_prefill_tokens: int  # scheduled tokens of requests still short of their prompt end
    num_decode_tokens: int
    kv_tokens_read: int = 0  # context tokens the step attends over (sum of chunk ends)
    decode_kv_tokens: int = 0  # the same over decode chunks only
    prefill_pairs: int = 0  # (query, key) pairs the prefill chunks attend (causal)
    max_prefill_start: int = 0  # the longest context a prefill chunk starts at
    num_running: int = 0  # after scheduling
    num_waiting: int = 0
    kv_usage: float = 0.0
    mixed_budget: int = 0  # the governed prefill budget Bp of a mixed step (0: none)
    decode_only: bool = False  # a decode-burst step that deferred all prefill
    deadline_bypass: bool = False  # the oldest-waiter deadline opened this step
    # Waiters refused because they could never start: (req_id, why). They are gone.
    refused: tuple[tuple[str, str], ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens
