"""One schedule() call's working state."""

from __future__ import annotations

from hybridserve.kvcache import Allocation
from hybridserve.scheduler.controls import PrefillAllowance, PrefillDecision


class StepState:
    """What one schedule() call has decided so far."""

    __slots__ = (
        "admitted",
        "allocations",
        "budget",
        "decision",
        "new_reqs",
        "num_running_scheduled",
        "preempted",
        "prefill",
        "resumed",
        "running_prefill",
        "scheduled",
        "threshold",
    )

    def __init__(self, budget: int, threshold: int, decision: PrefillDecision) -> None:
        self.budget = budget
        self.threshold = threshold
        self.decision = decision
        self.prefill = PrefillAllowance(decision)  # the admissions' and the reclaim's use of it
        self.scheduled: dict[str, int] = {}
        self.allocations: dict[str, Allocation] = {}
        self.admitted: set[str] = set()
        self.new_reqs: list[tuple[str, int]] = []
        self.resumed: list[tuple[str, int]] = []
        self.preempted: list[str] = []
        self.running_prefill = False  # a running request's prefill chunk was scheduled
        self.num_running_scheduled = 0

    def record(
        self, req_id: str, num_new: int, allocation: Allocation, *, new_request: bool = False
    ) -> None:
        self.scheduled[req_id] = num_new
        self.allocations[req_id] = allocation
        self.budget -= num_new
        if new_request:
            self.admitted.add(req_id)

    def unschedule(self, req_id: str) -> None:
        """A victim scheduled earlier in this step gives its tokens back."""
        num = self.scheduled.pop(req_id, None)
        if num is not None:
            self.budget += num
            del self.allocations[req_id]

    def extend(self, req_id: str, extra: int, allocation: Allocation) -> None:
        """Add `extra` tokens to a request already in the step (reclaimed quanta)."""
        previous = self.allocations.get(req_id)
        if previous is not None:
            allocation = Allocation(
                tuple(
                    a + b
                    for a, b in zip(previous.new_block_ids, allocation.new_block_ids, strict=True)
                ),
                previous.block_copies + allocation.block_copies,
            )
        self.scheduled[req_id] = self.scheduled.get(req_id, 0) + extra
        self.allocations[req_id] = allocation
        self.budget -= extra
