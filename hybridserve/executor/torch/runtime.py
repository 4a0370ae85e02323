"""What running a real model needs besides the executor: loading a checkpoint (folder or GGUF)
with its tokenizer, its stop tokens, torch's threads and device, and a pool size.

Nothing here builds an Engine (that is `hybridserve.engine.assembly`, above this layer).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch.cpu_kernels import switched_off
from hybridserve.executor.torch.gguf_file import GGUFFile
from hybridserve.executor.torch.gguf_loader import load_gguf_model
from hybridserve.executor.torch.loader import load_model
from hybridserve.executor.torch.models.base import CausalLM
from hybridserve.executor.torch.tokenizer import TextTokenizer, gguf_tokenizer
from hybridserve.executor.torch.tokenizer import load_tokenizer as folder_tokenizer

_T = TypeVar("_T")

log = logging.getLogger(__name__)

KEEP_FREED_MEMORY_SWITCH = "HYBRIDSERVE_KEEP_FREED_MEMORY"
# glibc's mallopt parameters (malloc.h) and the trim threshold kept: 2 GiB (mallopt takes an int).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_KEPT_TOP_BYTES = 2**31 - 1


def in_passing_thread(build: Callable[[], _T]) -> _T:
    """`build()` run in a thread of its own that exits when it is done (its exception raised
    here), for model loading before another thread (a server's engine thread) runs the steps.

    OpenMP, torch's CPU threading, keeps a team of worker threads for every thread that has run
    parallel work. With more such workers alive than cores, libgomp throttles their spinning
    (to 100 spins, whatever OMP_WAIT_POLICY or GOMP_SPINCOUNT say), so each parallel region of
    the engine thread waits for workers to wake from sleep: Gemma 3 270M's decode step at
    batch 1 on 2 cores took 68-95 ms in the server against 58-63 ms in a single-threaded
    process. A thread that exits takes its team with it, and the engine thread's is then the
    only one (58-61 ms in the server)."""
    box: dict[str, _T] = {}
    failure: list[BaseException] = []

    def run() -> None:
        try:
            box["value"] = build()
        except BaseException as exc:  # raised again in the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="hybridserve-load", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return box["value"]


# Stop tokens chat models end a turn with, besides the model's own EOS ids.
TURN_ENDS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A loaded model, its tokenizer (None when not asked for, or a folder without one) and
    its stop ids: the model's EOS ids plus the tokenizer's end-of-turn tokens."""

    model: CausalLM
    tokenizer: TextTokenizer | None
    stop_token_ids: tuple[int, ...]


def load_checkpoint(path: Path, *, with_tokenizer: bool = True) -> Checkpoint:
    """The model of a checkpoint folder or a `.gguf` file, with its tokenizer."""
    tokenizer: TextTokenizer | None = None
    if path.is_file() and path.suffix == ".gguf":
        file = GGUFFile(path)
        model = load_gguf_model(path, file=file)
        tokenizer = gguf_tokenizer(path, file) if with_tokenizer else None
    else:
        model = load_model(path)
        tokenizer = folder_tokenizer(path) if with_tokenizer else None
    return Checkpoint(model, tokenizer, stop_token_ids(model, tokenizer))


def stop_token_ids(model: CausalLM, tokenizer: TextTokenizer | None) -> tuple[int, ...]:
    """The model's EOS ids and the tokenizer's end-of-turn tokens (`TURN_ENDS`), sorted."""
    stops = set(model.eos_token_ids())
    if tokenizer is not None:
        for name in TURN_ENDS:
            token_id = tokenizer.backend.token_to_id(name)
            if token_id is not None:
                stops.add(int(token_id))
    return tuple(sorted(stops))


def load_text_tokenizer(model_path: Path) -> TextTokenizer | None:
    """The tokenizer of a checkpoint folder or GGUF file, without loading the weights."""
    if model_path.is_file() and model_path.suffix == ".gguf":
        return gguf_tokenizer(model_path, GGUFFile(model_path))
    return folder_tokenizer(model_path)


def resolve_device(device: str, *, field: str = "--device") -> str:
    """`auto` is CUDA when available, else cpu; a CUDA device where there is none is an error."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(field, device, "CUDA is not available here; use cpu or auto")
    return device


def local_cuda_device() -> int:
    """The CUDA device index this process uses."""
    return int(torch.cuda.current_device())


def set_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads for the torch executor: `num_threads`, or (None) every core
    this process may run on (`os.sched_getaffinity`). Returns the count. Raises ConfigError."""
    if num_threads is None:
        num_threads = len(os.sched_getaffinity(0))
    if num_threads < 1:
        raise ConfigError("--threads", num_threads, "use 1 or more (or leave it out: all cores)")
    torch.set_num_threads(num_threads)
    return num_threads


@functools.cache
def keep_freed_memory() -> bool:
    """Make this process's C allocator (glibc's malloc) keep the memory of freed tensors for
    the next ones instead of handing it back to the system; True where that was done.

    glibc serves every allocation above its mmap threshold (which grows with use to at most 32
    MiB; a prefill's activations of 2,048 tokens of a 4,096-wide MLP are just above it) with a
    fresh `mmap` and unmaps it when freed, so the next step's tensor of the same size faults in
    every 4 KiB page again: an elementwise product into such a tensor took 11.4 ms where 1.9 ms
    went to the arithmetic (the Intel Xeon host, 2 threads). With mmap off and the heap's top
    trimmed only past 2 GiB, freed blocks are reused: a 2,048-token prefill step of the
    Granite-layout hybrid 8.2 -> 6.8 s, of Gemma 3 270M 2.08 -> 1.90 s. The price is that the
    process keeps its peak memory (as a caching allocator does). Process-wide and once
    (`serve`, `generate` and `calibrate` call it on a CPU); not on other C libraries, nor with
    `HYBRIDSERVE_KEEP_FREED_MEMORY=0`."""
    if switched_off(KEEP_FREED_MEMORY_SWITCH):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.debug("no mallopt in the C library (%s): freed memory goes back as it does", name)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    kept = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEPT_TOP_BYTES))
    log.info(
        "malloc keeps freed memory for reuse%s (%s=0 turns this off)",
        "" if kept else ": refused by the C library",
        KEEP_FREED_MEMORY_SWITCH,
    )
    return kept
