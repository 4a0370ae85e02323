"""Measure the torch executor's step times over a grid of batch shapes, and the device's peaks.

`measure_steps` builds StepPlans directly (no scheduler). A shape is one (num_new_tokens,
num_context_tokens, shared_tokens) triple per request (hybridserve.sim.calibration_fit maps
StepShapes onto them). Every request gets its own block table from a bump allocator (after the
blocks of a shared prefix, the same for every request that has one), one untimed step registers the
requests (their first chunk, `new_request`), then the same chunks run again without
`new_request` and are timed around `TorchExecutor.execute` (which synchronises CUDA) with
`time.perf_counter`, or, on a CPU with one torch thread, `time.thread_time`: the thread's CPU
time, which the load of other processes on a shared machine does not inflate. The K/V the
chunks attend to is written once up front (its values do not change a step's time). Shapes are
measured in interleaved rounds (every shape once per round) and each shape's time is the median
over rounds of the round's fastest step, so a burst of load from another process spoils one
sample of many shapes rather than every sample of one.

`measure_peaks` is the "datasheet" of a device that is not in the GPU catalog (a CPU): the best
FLOP/s of a large fp32 and bf16 matmul, the bytes/s of a large tensor copy (read + write), and
the bytes/s one row times a large fp32 and bf16 matrix reads (the weight stream of a decode
step, recorded; `calibration_fit.pinned_hbm` says why a fit does not pin `hbm` to it).
The fitted efficiencies are then fractions of these measured peaks, at most 1, so a peak read
low caps every fitted rate: on a shared 2-core host one reading of the fp32 peak, taken once
before the steps, came out 126 GFLOP/s where the calibration minutes before read 194, and the
fits it bounded priced every prefill 1.2-1.5x its time. `measure_device` therefore measures the
peaks before every round of steps and after the last, and keeps the best of each rate
(`best_peaks`): a burst of load spoils one reading, not the calibration.

`measure_device` is the torch half of `hybridserve calibrate`: load a checkpoint, time every
shape, measure the peaks when asked; `hybridserve.sim.calibration_run` checks the request
before and fits the times after.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import ScheduledChunk, StepPlan
from hybridserve.executor.torch.executor import TorchExecutor
from hybridserve.executor.torch.loader import load_model
from hybridserve.kvcache.spec import MambaSpec

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# One request of a step: (num_new_tokens, num_context_tokens, shared_tokens): the first
# shared_tokens of its context (whole blocks) sit in the same blocks as those of every other
# request of the step with shared tokens, as a shared system prompt does under prefix caching.
# The simulator's StepShape maps onto a sequence of these (the executor layer does not import
# the simulator).
RequestTokens = tuple[int, int, int]


def executor_for(
    model: torch.nn.Module, *, max_tokens: int, max_requests: int, device: str, block_size: int = 16
) -> TorchExecutor:
    """A TorchExecutor with blocks for `max_tokens` tokens spread over `max_requests` requests."""
    num_blocks = -(-max_tokens // block_size) + max_requests + 1
    return TorchExecutor(
        model,  # type: ignore[arg-type]
        num_blocks=num_blocks,
        block_size=block_size,
        device=device,
        max_num_seqs=max_requests,
    )


class StepTimer:
    """Runs StepPlans of a given shape (one `RequestTokens` per request) and times them."""

    def __init__(
        self,
        executor: TorchExecutor,
        *,
        vocab_size: int,
        seed: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if any(isinstance(spec, MambaSpec) for spec in executor.groups.specs):
            raise ConfigError(
                "model",
                "recurrent-state layers",
                "calibration times attention-only models (Llama, Mistral, Gemma 3); "
                "measure one of those",
            )
        self.executor = executor
        self.clock = clock  # wall (perf_counter) or this thread's CPU time (thread_time)
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.num_groups = len(executor.groups.specs)
        self._step_id = 0
        # The context a timed chunk attends to is never written by a prefill here: write every
        # K/V page once, so that reads hit memory as after a real prefill and not the
        # untouched zero pages of a fresh allocation.
        cache = executor.cache
        for layer in range(len(executor.groups.layer_group)):
            if not cache.is_state_layer(layer):
                for tensor in cache.kv(layer):
                    tensor.fill_(0.01)

    def _plan(self, chunks: Sequence[ScheduledChunk], finished: Sequence[str] = ()) -> StepPlan:
        self._step_id += 1
        return StepPlan(self._step_id, tuple(chunks), finished_req_ids=tuple(finished))

    def _chunks(self, shape: Sequence[RequestTokens]) -> list[ScheduledChunk]:
        bs = self.executor.block_size
        shared_blocks = max((shared // bs for _, _, shared in shape), default=0)
        if any(shared % bs or shared > context for _, context, shared in shape):
            raise ConfigError(
                "shape", list(shape), f"share whole blocks of {bs} tokens within each context"
            )
        prefix = tuple(range(1, 1 + shared_blocks))  # block 0 is the null block of state tables
        next_block = 1 + shared_blocks
        chunks = []
        for index, (num_new, num_context, shared) in enumerate(shape):
            num_blocks = -(-(num_context + num_new) // bs) - shared // bs
            table = prefix[: shared // bs] + tuple(range(next_block, next_block + num_blocks))
            next_block += num_blocks
            tokens = tuple(self.rng.randrange(self.vocab_size) for _ in range(num_new))
            chunks.append(
                ScheduledChunk(
                    req_id=f"calib-{index}",
                    start=num_context,
                    token_ids=tokens,
                    block_ids=(table,) * self.num_groups,
                    sample=True,
                    new_request=True,
                )
            )
        if next_block > self.executor.num_blocks:
            raise ConfigError(
                "shape", f"{len(shape)} requests", "build the executor with more blocks"
            )
        return chunks

    def time(self, shape: Sequence[RequestTokens], *, repeats: int, warmup: int = 1) -> list[float]:
        """`repeats` timed steps of `shape`, after one untimed step that registers its requests
        and `warmup` untimed steps like the timed ones (the allocator and caches settle)."""
        first = self._chunks(shape)
        self.executor.execute(self._plan(first))
        again = [c._replace(new_request=False, block_ids=((),) * self.num_groups) for c in first]
        for _ in range(warmup):
            self.executor.execute(self._plan(again))
        samples = []
        for _ in range(repeats):
            plan = self._plan(again)
            began = self.clock()
            self.executor.execute(plan)
            samples.append(self.clock() - began)
        self.executor.execute(self._plan((), finished=[c.req_id for c in first]))
        return samples


def measure_steps(
    timer: StepTimer,
    shapes: Sequence[Sequence[RequestTokens]],
    *,
    rounds: int,
    repeats: int,
    progress: Callable[[int, int], None] | None = None,
    between_rounds: Callable[[], None] | None = None,
) -> list[float]:
    """Seconds per shape: over `rounds` interleaved passes, the median of each pass's fastest
    of `repeats` timed steps. Load from other processes only adds time: the fastest of a few
    back-to-back steps drops short interruptions, the median over passes a loaded pass.
    `progress(done, total)` after each shape of each pass; `between_rounds()` before each pass
    and after the last."""
    samples: list[list[float]] = [[] for _ in shapes]
    total = len(shapes) * rounds
    for round_index in range(rounds):
        if between_rounds is not None:
            between_rounds()
        for index, shape in enumerate(shapes):
            samples[index].append(min(timer.time(shape, repeats=repeats)))
            if progress is not None:
                progress(round_index * len(shapes) + index + 1, total)
    if between_rounds is not None:
        between_rounds()
    return [statistics.median(s) for s in samples]


@dataclass(frozen=True, kw_only=True, slots=True)
class DevicePeaks:
    """Best rates of short microbenchmarks on one device."""

    fp32_flops: float
    bf16_flops: float
    copy_bytes_per_s: float  # bytes read + written per second by a large tensor copy
    memory_bytes: float  # device memory (a CPU: physical RAM)
    # bytes per second a one-row matmul reads from an fp32 / bf16 matrix larger than the caches
    fp32_stream_bytes_per_s: float | None = None
    bf16_stream_bytes_per_s: float | None = None


def _best_seconds(
    fn: Callable[[], object], device: torch.device, repeats: int, clock: Callable[[], float]
) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, clock() - began)
    return best


def measure_peaks(
    device: str | torch.device,
    *,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    stream_bytes: int | None = None,
) -> DevicePeaks:
    """Matmul FLOP/s (fp32 and bf16), copy bytes/s and weight-stream bytes/s (fp32 and bf16,
    a matrix of `stream_bytes`: the model's weights, so that a model its caches hold streams
    from them as its steps do; None: 256 MiB, 1 GiB on a GPU) of `device`, best of `repeats`
    each."""
    dev = torch.device(device)
    n = 8192 if dev.type == "cuda" else 1024
    flops: dict[torch.dtype, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, device=dev).to(dtype)
        b = torch.randn(n, n, device=dev).to(dtype)
        flops[dtype] = 2 * n**3 / _best_seconds(partial(torch.matmul, a, b), dev, repeats, clock)
    elements = (1 << 30 if dev.type == "cuda" else 1 << 26) // 4  # 1 GiB / 256 MiB of fp32
    src = torch.ones(elements, device=dev)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(partial(dst.copy_, src), dev, repeats, clock)
    del src, dst
    stream = {
        dtype: _stream_bytes_per_s(dev, dtype, repeats, clock, stream_bytes)
        for dtype in (torch.float32, torch.bfloat16)
    }
    if dev.type == "cuda":
        memory = float(torch.cuda.get_device_properties(dev).total_memory)
    else:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return DevicePeaks(
        fp32_flops=flops[torch.float32],
        bf16_flops=flops[torch.bfloat16],
        copy_bytes_per_s=2 * elements * 4 / copy_s,
        memory_bytes=memory,
        fp32_stream_bytes_per_s=stream[torch.float32],
        bf16_stream_bytes_per_s=stream[torch.bfloat16],
    )


STREAM_COLUMNS = 4096  # the weight matrix's inputs: a hidden size of a mid-sized model
MIN_STREAM_BYTES = 1 << 20  # a calibration streams its model's weight bytes, within these
MAX_STREAM_BYTES = 1 << 30


def _stream_bytes_per_s(
    dev: torch.device,
    dtype: torch.dtype,
    repeats: int,
    clock: Callable[[], float],
    total_bytes: int | None = None,
) -> float:
    """Bytes per second one row times a `dtype` matrix of `total_bytes` (256 MiB, 1 GiB on a
    GPU) reads: the rate at which a decode step's linear layers stream their weights."""
    total = total_bytes or (1 << 30 if dev.type == "cuda" else 1 << 28)
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = total // (itemsize * STREAM_COLUMNS)
    weight = torch.randn(rows, STREAM_COLUMNS, device=dev).to(dtype)
    x = torch.randn(1, STREAM_COLUMNS, device=dev).to(dtype)
    seconds = _best_seconds(lambda: torch.nn.functional.linear(x, weight), dev, repeats, clock)
    return rows * STREAM_COLUMNS * itemsize / seconds


def best_peaks(readings: Sequence[DevicePeaks]) -> DevicePeaks:
    """The best of each rate over several readings of the peaks (load only slows a reading)."""
    if not readings:
        raise ValueError("best_peaks needs at least one reading")
    return DevicePeaks(
        fp32_flops=max(r.fp32_flops for r in readings),
        bf16_flops=max(r.bf16_flops for r in readings),
        copy_bytes_per_s=max(r.copy_bytes_per_s for r in readings),
        memory_bytes=readings[0].memory_bytes,
        fp32_stream_bytes_per_s=_best_of(r.fp32_stream_bytes_per_s for r in readings),
        bf16_stream_bytes_per_s=_best_of(r.bf16_stream_bytes_per_s for r in readings),
    )


def _best_of(rates: Iterable[float | None]) -> float | None:
    read = [r for r in rates if r is not None]
    return max(read) if read else None


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceMeasurement:
    """What `measure_device` measured: seconds per shape (in order), the peaks (when asked)
    and the torch it ran under."""

    seconds: tuple[float, ...]
    peaks: DevicePeaks | None
    torch_version: str
    num_threads: int


def measure_device(
    model_path: Path,
    *,
    device: str,
    dtype: str,
    clock: str,
    num_threads: int | None,
    requests: Sequence[Sequence[RequestTokens]],
    rounds: int,
    repeats: int,
    vocab_size: int,
    seed: int,
    max_tokens: int,
    max_requests: int,
    with_peaks: bool,
    progress: Callable[[str, int, int], None] | None = None,
) -> DeviceMeasurement:
    """Load the checkpoint in `dtype` ("fp32", "bf16", "fp16") on `device`, time each step
    shape of `requests` with `measure_steps`, and measure the device's peaks when `with_peaks`
    (before every round and after the last, the best of each rate: `best_peaks`).

    `clock` is "wall" (perf_counter) or "cpu" (this thread's CPU time: one torch thread only).
    `num_threads` sets torch's intra-op threads (None: leave them). `progress(what, done,
    total)` reports "peaks" then "steps". Raises ConfigError."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device", device, "CUDA is not available here; use --device cpu")
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    threads = torch.get_num_threads()
    if clock == "cpu" and threads != 1:
        raise ConfigError(
            "--clock", clock, f"it counts one thread's time, torch runs {threads}; add --threads 1"
        )
    timer_clock = time.thread_time if clock == "cpu" else time.perf_counter
    model = load_model(model_path, dtype=TORCH_DTYPES[dtype])
    readings: list[DevicePeaks] = []
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    stream_bytes = min(max(weight_bytes, MIN_STREAM_BYTES), MAX_STREAM_BYTES)

    def read_peaks() -> None:  # before every round of steps and after the last
        if with_peaks:
            readings.append(measure_peaks(device, clock=timer_clock, stream_bytes=stream_bytes))

    if with_peaks and progress is not None:
        progress("peaks", 0, 1)
    executor = executor_for(model, max_tokens=max_tokens, max_requests=max_requests, device=device)
    timer = StepTimer(executor, vocab_size=vocab_size, seed=seed, clock=timer_clock)
    seconds = measure_steps(
        timer,
        requests,
        rounds=rounds,
        repeats=repeats,
        progress=None if progress is None else lambda d, t: progress("steps", d, t),
        between_rounds=read_peaks,
    )
    return DeviceMeasurement(
        seconds=tuple(seconds),
        peaks=best_peaks(readings) if readings else None,
        torch_version=str(torch.__version__),
        num_threads=torch.get_num_threads(),
    )
