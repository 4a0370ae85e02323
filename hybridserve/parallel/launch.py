"""Start a DCP group: N local processes (spawn), or one rank of a `torchrun`-style launch.

On one host `run_ranks(fn, N, ...)` spawns N processes on a free port and returns each rank's
result, with a deadline so a hung rank cannot hang the caller. On several hosts every process
calls `init_from_env()`, which reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hybridserve.parallel.group import DcpGroup

__all__ = [
    "find_free_port",
    "init_from_env",
    "join_local_group",
    "leave_group",
    "process_context",
    "run_ranks",
    "torchrun_env_present",
]

ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def find_free_port() -> int:
    """A TCP port that was free a moment ago (bind port 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_env_present() -> bool:
    """True when this process was started by `torchrun` (or set up the same way)."""
    return all(key in os.environ for key in ENV_KEYS)


def init_from_env(
    *, interleave: int = 1, backend: str | None = None, timeout_s: float = 120.0
) -> DcpGroup:
    """Join the default process group from the torchrun variables; the whole world is one DCP
    group. `backend` defaults to nccl when CUDA is available, else gloo."""
    missing = [key for key in ENV_KEYS if key not in os.environ]
    if missing:
        raise RuntimeError(f"set {', '.join(missing)} (as torchrun does) to join a DCP group")
    chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if chosen == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(
            chosen,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    return DcpGroup(rank=rank, world_size=world_size, interleave=interleave)


def join_local_group(
    rank: int,
    world_size: int,
    port: int,
    *,
    interleave: int = 1,
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> DcpGroup:
    """Join a group of `world_size` processes on this host that meet at 127.0.0.1:`port` (the
    default process group; every rank calls it, and it returns once all have)."""
    if backend == "nccl":
        torch.cuda.set_device(rank % max(torch.cuda.device_count(), 1))
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return DcpGroup(rank=rank, world_size=world_size, interleave=interleave)


def leave_group() -> None:
    """Tear down the default process group, if any: a rank must, before it exits (gloo's
    threads otherwise abort the process at interpreter exit)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _encode(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _worker(
    rank: int,
    world_size: int,
    port: int,
    options: dict[str, Any],
    fn: Callable[..., object],
    args: tuple[object, ...],
    results: mp.Queue[tuple[int, bool, bytes | str]],
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    try:
        dcp = init_from_env(**options)
        results.put((rank, True, _encode(fn(dcp, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        leave_group()


def _next_answer(
    results: mp.Queue[tuple[int, bool, bytes | str]],
    deadline: float,
    world_size: int,
    answers: dict[int, object],
) -> tuple[int, bytes]:
    try:
        rank, ok, payload = results.get(timeout=max(deadline - time.monotonic(), 0.01))
    except queue.Empty:
        waiting = sorted(set(range(world_size)) - set(answers))
        raise RuntimeError(f"DCP ranks {waiting} did not answer in time") from None
    if isinstance(payload, str) or not ok:
        raise RuntimeError(f"DCP rank {rank} failed:\n{payload!s}")
    return rank, payload


def process_context() -> mp.context.ForkServerContext | mp.context.SpawnContext:
    """Ranks fork from a forkserver that has imported torch once (and never touched CUDA), so a
    group starts without each rank paying for `import torch`; spawn where forkserver is absent."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
    return ctx


def run_ranks(
    fn: Callable[..., object],
    world_size: int,
    *args: object,
    interleave: int = 1,
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> list[Any]:
    """`[fn(DcpGroup for rank r, *args) for r in range(world_size)]`, one process per rank.

    `fn` must be importable by the children (a module-level function). With `world_size == 1`
    it runs in this process without `torch.distributed`. Raises RuntimeError with the failing
    rank's traceback, or when a rank has not answered after `timeout_s`; kills the stragglers.
    """
    if world_size == 1:
        return [fn(DcpGroup(interleave=interleave), *args)]
    ctx = process_context()
    results: mp.Queue[tuple[int, bool, bytes | str]] = ctx.Queue()
    options = {"interleave": interleave, "backend": backend, "timeout_s": timeout_s}
    port = find_free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, options, fn, args, results))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    answers: dict[int, object] = {}
    try:
        while len(answers) < world_size:
            rank, payload = _next_answer(results, deadline, world_size, answers)
            answers[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        for proc in procs:
            proc.join(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [answers[rank] for rank in range(world_size)]
