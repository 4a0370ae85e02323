"""An Engine over the TorchExecutor from a model path, and the DCP generation job.

Importing this module imports no torch: the torch side (`hybridserve.executor.torch.runtime`)
is loaded when a runtime is built. The engine itself is assembled by
`hybridserve.engine.assembly`, as every engine is."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from hybridserve.core.config import SpeculativeConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.request import Request
from hybridserve.engine.assembly import ModelCache, build_engine, resolve_engine_config
from hybridserve.engine.engine import Engine
from hybridserve.engine.settings import SettingsSources
from hybridserve.executor.api import Executor
from hybridserve.kvcache.spec import state_quantum

# The context limit of offline generation unless `--max-model-len` (or the settings file)
# sets one: prompt plus output, in tokens.
GENERATE_MAX_MODEL_LEN = 32_768

if TYPE_CHECKING:
    from rich.progress import Progress

    from hybridserve.executor.torch.dcp import DcpDriver
    from hybridserve.executor.torch.executor import TorchExecutor
    from hybridserve.executor.torch.tokenizer import TextTokenizer
    from hybridserve.parallel.group import DcpGroup


@dataclass
class TorchRuntime:
    engine: Engine
    executor: TorchExecutor
    tokenizer: TextTokenizer | None
    stop_token_ids: tuple[int, ...]
    driver: DcpDriver | None = None  # on rank 0 of a DCP group

    def close(self) -> None:
        """Release the other ranks of a DCP group (a no-op without one)."""
        if self.driver is not None:
            self.driver.close()


@dataclass(frozen=True)
class PoolFor:
    """A pool sized once the model's cache groups are known: room for requests of `lengths`
    prompt tokens and `max_tokens` more each, resident at once in every group (`blocks_for`)."""

    lengths: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class DcpJob:
    """Offline generation on a DCP group: what every rank needs to build the same runtime.

    `waves` run one after another on the same engine, so a later wave can hit the prefix cache
    of an earlier one."""

    model_path: str
    waves: tuple[tuple[Request, ...], ...]
    num_blocks: int | PoolFor
    block_size: int = 16
    device: str = "cpu"
    # The preset, the settings file and the scheduler flags, resolved on every rank alike.
    settings: SettingsSources = field(default_factory=SettingsSources)
    load_tokenizer: bool = False  # rank 0 adds the tokenizer's end-of-turn ids to the stops
    show_progress: bool = False  # rank 0 draws a progress bar on stderr


@dataclass
class DcpOutcome:
    """Rank 0's result: output tokens and the prefix-cache hit (tokens) of each request."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    hit_tokens: dict[str, int] = field(default_factory=dict)
    num_steps: int = 0
    num_finished: int = 0
    generate_s: float = 0.0  # wall seconds from the first step to the last (no model load)


def run_dcp_job(dcp: DcpGroup, job: DcpJob) -> DcpOutcome | None:
    """One rank of a DCP generation job (every rank of the group calls it; see
    `hybridserve.parallel.run_ranks` and `init_from_env`). Rank 0 schedules and returns the
    outcome; the other ranks execute rank 0's plans and return None."""
    from hybridserve.executor.torch.dcp import confirm_ready, follow_plans
    from hybridserve.executor.torch.runtime import local_cuda_device

    try:
        runtime = build_runtime(
            Path(job.model_path),
            num_blocks=job.num_blocks,
            block_size=job.block_size,
            device=job.device
            if not job.device.startswith("cuda")
            else f"cuda:{local_cuda_device()}",
            settings=job.settings,
            load_tokenizer=job.load_tokenizer and dcp.rank == 0,
            dcp=dcp,
        )
    except Exception as exc:
        confirm_ready(dcp, f"{type(exc).__name__}: {exc}")
        raise
    confirm_ready(dcp, None)
    if dcp.rank != 0:
        follow_plans(runtime.executor)
        return None
    outcome = DcpOutcome()
    start = time.perf_counter()
    try:
        if job.show_progress:
            _run_with_progress(runtime, job, outcome)
        else:
            for wave in job.waves:
                _run_wave(runtime, wave, outcome)
    finally:
        runtime.close()
    outcome.generate_s = time.perf_counter() - start
    return outcome


def generation_progress(label: str) -> Progress:
    """The progress bar of offline generation on stderr: requests done, tokens, time."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as RichProgress

    columns = (
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[tokens]} tokens"),
        TimeElapsedColumn(),
    )
    return RichProgress(*columns, console=Console(stderr=True), transient=True)


def _run_with_progress(runtime: TorchRuntime, job: DcpJob, outcome: DcpOutcome) -> None:
    total = sum(len(wave) for wave in job.waves)
    label = f"generating on {runtime.executor.dcp.world_size} DCP ranks"
    with generation_progress(label) as progress:
        task = progress.add_task("generate", total=total, tokens=0)
        for wave in job.waves:
            _run_wave(
                runtime,
                wave,
                outcome,
                report=lambda done, tokens: progress.update(task, completed=done, tokens=tokens),
            )


def _run_wave(
    runtime: TorchRuntime,
    wave: tuple[Request, ...],
    outcome: DcpOutcome,
    *,
    report: Callable[[int, int], None] | None = None,  # (finished requests, tokens so far)
) -> None:
    engine = runtime.engine
    for asked in wave:
        sampling = asked.sampling
        if not sampling.ignore_eos:
            stops = tuple(sorted({*sampling.stop_token_ids, *runtime.stop_token_ids}))
            sampling = replace(sampling, stop_token_ids=stops)
        # A fresh Request: the job's own objects stay unscheduled (a job can run again).
        request = Request(
            req_id=asked.req_id,
            prompt_token_ids=asked.prompt_token_ids,
            sampling=sampling,
            priority=asked.priority,
            cache_salt=asked.cache_salt,
        )
        engine.add_request(request)
        outcome.tokens[request.req_id] = []
    while engine.has_requests():
        step = engine.step()
        if step.failed:
            req_id, reason = step.failed[0]
            raise RuntimeError(f"request {req_id!r} failed: {reason}")
        outcome.num_steps += 1
        for req_id, hit in (*step.scheduled.new_reqs, *step.scheduled.resumed):
            outcome.hit_tokens.setdefault(req_id, hit)
        for out in step.outputs:
            outcome.tokens[out.req_id].extend(out.new_token_ids)
            outcome.num_finished += out.finished
        if report is not None and step.outputs:
            report(outcome.num_finished, sum(len(t) for t in outcome.tokens.values()))


def parse_speculation(text: str | None) -> SpeculativeConfig:
    """`ngram:K` (K draft tokens) or None for no speculation."""
    if not text:
        return SpeculativeConfig()
    method, _, count = text.partition(":")
    if method != "ngram":
        raise ConfigError("--spec", text, "use ngram:K, e.g. ngram:3")
    try:
        k = int(count) if count else 3
    except ValueError:
        raise ConfigError("--spec", text, "K is a positive integer, e.g. ngram:3") from None
    if k < 1:
        raise ConfigError("--spec", text, "K is a positive integer, e.g. ngram:3")
    return SpeculativeConfig.from_name("ngram", k)


def build_runtime(
    model_path: Path,
    *,
    num_blocks: int | PoolFor,
    block_size: int = 16,
    device: str = "cpu",
    speculative: SpeculativeConfig | None = None,
    settings: SettingsSources | None = None,
    load_tokenizer: bool = True,
    dcp: DcpGroup | None = None,
) -> TorchRuntime:
    """Load the model (and its tokenizer) and assemble scheduler, cache and executor, with the
    `settings` (preset, then file, then flags; the default preset when None) resolved over the
    model's cache and configured by `resolve_engine_config`, as every engine is. `num_blocks`
    is the pool, or `PoolFor` requests in every cache group of the model.

    With a `dcp` group of N > 1 ranks, the executor holds this rank's KV shard and, on rank 0,
    the engine drives the group through a `DcpDriver` (call `runtime.close()` when done)."""
    from hybridserve.executor.torch.executor import TorchExecutor
    from hybridserve.executor.torch.models.base import derive_cache_groups
    from hybridserve.executor.torch.runtime import load_checkpoint, resolve_device

    speculative = speculative or SpeculativeConfig()
    device = resolve_device(device)
    loaded = load_checkpoint(model_path, with_tokenizer=load_tokenizer)
    groups = derive_cache_groups(loaded.model.layer_caches(), block_size=block_size).specs
    resolved = (settings or SettingsSources()).resolve(
        quantum=state_quantum(groups), max_model_len=GENERATE_MAX_MODEL_LEN
    )
    if isinstance(num_blocks, PoolFor):
        num_blocks = blocks_for(
            list(num_blocks.lengths),
            max_tokens=num_blocks.max_tokens,
            block_size=block_size,
            num_groups=len(groups),
        )
    executor = TorchExecutor(
        loaded.model,
        num_blocks=num_blocks,
        block_size=block_size,
        device=device,
        speculative=speculative,
        max_num_seqs=resolved.scheduler.max_num_seqs,
        dcp=dcp,
    )
    driver = None
    if dcp is not None and dcp.world_size > 1 and dcp.rank == 0:
        from hybridserve.executor.torch.dcp import DcpDriver

        driver = DcpDriver(executor)
    engine_executor: Executor = driver or executor
    model = ModelCache(
        groups=executor.groups.specs,
        speculative=executor.speculative,
        dcp=executor.dcp.world_size,
    )
    config = resolve_engine_config(resolved, model, num_blocks=executor.num_blocks)
    parts = build_engine(config, lambda layout: engine_executor)
    return TorchRuntime(parts.engine, executor, loaded.tokenizer, loaded.stop_token_ids, driver)


def blocks_for(lengths: list[int], *, max_tokens: int, block_size: int, num_groups: int) -> int:
    """Enough blocks for every request to be resident at once, plus slack."""
    per_group = sum(-(-(n + max_tokens + block_size) // block_size) for n in lengths)
    return max(64, per_group * num_groups + 16)
