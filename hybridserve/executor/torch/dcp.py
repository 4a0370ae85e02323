"""The TorchExecutor on a decode-context-parallel group: rank 0 schedules, every rank executes.

Every rank holds the whole model and its own shard of the full-attention / MLA KV (one block id
covers `block_size * N` tokens, `block_size` on each rank; replicated groups are whole on every
rank). Rank 0 runs the Engine with a `DcpDriver` as its executor: each StepPlan is broadcast to
the group, then executed on rank 0's shard while ranks 1..N-1, in `follow_plans`, execute the
same plan on theirs; the attention layers meet in their collectives. Sampled tokens are the same
on every rank (the merged attention is), and only rank 0's reach the scheduler.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import StepPlan, StepResult
from hybridserve.executor.torch.executor import TorchExecutor
from hybridserve.parallel.group import DcpGroup
from hybridserve.parallel.launch import (
    find_free_port,
    init_from_env,
    join_local_group,
    leave_group,
    process_context,
    run_ranks,
    torchrun_env_present,
)

__all__ = ["DcpDriver", "LocalDcpRanks", "confirm_ready", "follow_plans", "run_on_group"]

logger = logging.getLogger(__name__)

Job = TypeVar("Job")
Outcome = TypeVar("Outcome")


def run_on_group(
    rank_main: Callable[[DcpGroup, Job], Outcome],
    job: Job,
    *,
    ranks: int,
    device: str = "cpu",
    interleave: int = 1,
    timeout_s: float = 3600.0,
    announce: Callable[[str], None] | None = None,
) -> Outcome:
    """`rank_main(group, job)` on every rank of a DCP group of `ranks` ranks; returns rank 0's
    result, or under torchrun this process's rank's (the world is the group).

    Under torchrun the group is joined from the environment and left afterwards; WORLD_SIZE
    must equal `ranks` (ConfigError otherwise). Else `ranks` local processes are spawned (gloo
    on CPU, nccl on CUDA; `announce` is told first) and `rank_main` must be a module-level
    function. Raises RuntimeError when a rank fails or the group outlives `timeout_s`."""
    if torchrun_env_present():
        group = init_from_env(interleave=interleave, timeout_s=timeout_s)
        try:
            if group.world_size != ranks:
                raise ConfigError(
                    "--dcp",
                    ranks,
                    f"torchrun started WORLD_SIZE={group.world_size}; give --dcp "
                    f"{group.world_size} or start {ranks} processes",
                )
            return rank_main(group, job)
        finally:
            leave_group()
    if announce is not None:
        announce(f"starting {ranks} DCP ranks ...")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    results = run_ranks(
        rank_main, ranks, job, interleave=interleave, backend=backend, timeout_s=timeout_s
    )
    outcome: Outcome = results[0]
    return outcome


def confirm_ready(dcp: DcpGroup, failure: str | None) -> None:
    """Every rank says whether it built its executor (`failure` None) or why not; raises on
    every rank when any failed, naming it. Without this, a rank that failed alone would leave
    the others waiting in their first collective until the group's timeout."""
    if dcp.world_size == 1:
        if failure is not None:
            raise RuntimeError(failure)
        return
    reports: list[str | None] = [None] * dcp.world_size
    dist.all_gather_object(reports, failure, group=dcp.process_group)
    failed = [f"rank {rank}: {message}" for rank, message in enumerate(reports) if message]
    if failed:
        raise RuntimeError("DCP ranks could not start: " + "; ".join(failed))


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


def follower_options(executor_options: dict[str, Any]) -> dict[str, Any]:
    """A follower's TorchExecutor keyword arguments from what rank 0 sent: `grammar_source`
    (its structured-output grammars' tokenizer, vocabulary and end tokens) becomes an equal
    `Grammars`, so the rank samples a constrained request as rank 0 does and keeps the same
    tokens and recurrent states."""
    options = dict(executor_options)
    grammar_source = options.pop("grammar_source", None)
    if grammar_source is not None:
        from hybridserve.executor.grammar import Grammars

        tokenizer_json, vocab_size, eos_token_ids = grammar_source
        options["grammars"] = Grammars(
            tokenizer_json, vocab_size=vocab_size, eos_token_ids=eos_token_ids
        )
    return options


def _follower_main(
    rank: int,
    world_size: int,
    port: int,
    model_path: str,
    executor_options: dict[str, Any],
    interleave: int,
    backend: str,
    timeout_s: float,
) -> None:
    """A spawned rank 1..N-1: load the model, join the group, execute plans until closed.

    It ignores SIGINT and SIGTERM: a Ctrl-C or a `kill` of the process group reaches every
    rank at once, and rank 0 must still find its followers there to release them in order."""
    from hybridserve.executor.torch.loader import load_model

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        dcp = join_local_group(
            rank, world_size, port, interleave=interleave, backend=backend, timeout_s=timeout_s
        )
        options = follower_options(executor_options)
        if backend == "nccl":
            options["device"] = f"cuda:{torch.cuda.current_device()}"
        try:
            executor = TorchExecutor(load_model(model_path), dcp=dcp, **options)
        except Exception as exc:
            confirm_ready(dcp, f"{type(exc).__name__}: {exc}")
            raise
        confirm_ready(dcp, None)
        follow_plans(executor)
    finally:
        leave_group()


class LocalDcpRanks:
    """Ranks 1..N-1 of a DCP group as local processes, with this process as rank 0.

    `start` spawns the followers (each loads the model itself and builds a TorchExecutor with
    `executor_options`), joins the group as rank 0 and returns its DcpGroup; build rank 0's
    executor with it and drive it through a DcpDriver. `close` releases the followers (after
    the driver closed) and leaves the group. gloo on CPU, nccl on CUDA (rank r on cuda:r).
    """

    def __init__(self) -> None:
        self._procs: list[mp.process.BaseProcess] = []
        self.group: DcpGroup | None = None

    def start(
        self,
        model_path: str,
        world_size: int,
        *,
        executor_options: dict[str, Any],
        interleave: int = 1,
        timeout_s: float = 300.0,
    ) -> DcpGroup:
        device = str(executor_options.get("device", "cpu"))
        backend = "nccl" if device.startswith("cuda") else "gloo"
        ctx = process_context()
        port = find_free_port()
        for rank in range(1, world_size):
            proc = ctx.Process(
                target=_follower_main,
                args=(
                    rank,
                    world_size,
                    port,
                    model_path,
                    executor_options,
                    interleave,
                    backend,
                    timeout_s,
                ),
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
        try:
            self.group = join_local_group(
                0, world_size, port, interleave=interleave, backend=backend, timeout_s=timeout_s
            )
        except BaseException:
            self.close()
            raise
        return self.group

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait for the followers to end (kill the stragglers) and leave the group."""
        for proc in self._procs:
            proc.join(timeout_s)
            if proc.is_alive():
                logger.warning("DCP rank process %s did not exit; killing it", proc.pid)
                proc.kill()
                proc.join()
        self._procs.clear()
        leave_group()
        self.group = None

    @property
    def alive(self) -> int:
        return sum(p.is_alive() for p in self._procs)
