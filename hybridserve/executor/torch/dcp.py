"""The TorchExecutor on a decode-context-parallel group: rank 0 schedules, every rank executes.

Every rank holds the whole model and its own shard of the full-attention / MLA KV (one block id
covers `block_size * N` tokens, `block_size` on each rank; replicated groups are whole on every
rank). Rank 0 runs the Engine with a `DcpDriver` as its executor: each StepPlan is broadcast to
the group, then executed on rank 0's shard while ranks 1..N-1, in `follow_plans`, execute the
same plan on theirs; the attention layers meet in their collectives. Sampled tokens are the same
on every rank (the merged attention is), and only rank 0's reach the scheduler.
"""

from __future__ import annotations

import torch.distributed as dist

from hybridserve.core.plan import StepPlan, StepResult
from hybridserve.executor.torch.runner import TorchExecutor

__all__ = ["DcpDriver", "follow_plans"]


def _broadcast(plan: StepPlan | None, executor: TorchExecutor) -> StepPlan | None:
    box: list[StepPlan | None] = [plan]
    dcp = executor.dcp
    src = dist.get_global_rank(dcp.process_group, 0) if dcp.process_group is not None else 0
    dist.broadcast_object_list(box, src=src, group=dcp.process_group, device=executor.device)
    return box[0]


class DcpDriver:
    """Rank 0's executor: broadcasts each plan to the group, then runs it on its own shard."""

    def __init__(self, executor: TorchExecutor) -> None:
        if executor.dcp.rank != 0:
            raise ValueError(f"the driver runs on rank 0, not rank {executor.dcp.rank}")
        self.executor = executor
        self.closed = False

    def execute(self, plan: StepPlan) -> StepResult:
        if self.closed:
            raise RuntimeError("the DCP group was closed; no rank executes plans any more")
        if self.executor.dcp.world_size > 1:
            _broadcast(plan, self.executor)
        return self.executor.execute(plan)

    def close(self) -> None:
        """Release ranks 1..N-1 from `follow_plans` (idempotent)."""
        if not self.closed and self.executor.dcp.world_size > 1:
            _broadcast(None, self.executor)
        self.closed = True


def follow_plans(executor: TorchExecutor) -> int:
    """Ranks 1..N-1: execute every plan rank 0 broadcasts until its driver closes. Returns the
    number of plans executed."""
    if executor.dcp.rank == 0:
        raise ValueError("rank 0 drives the group (DcpDriver); follow_plans is for ranks 1..N-1")
    steps = 0
    while (plan := _broadcast(None, executor)) is not None:
        executor.execute(plan)
        steps += 1
    return steps
