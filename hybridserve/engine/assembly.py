"""The one place an engine is configured and assembled: cache layout, cache, scheduler,
executor, engine.

Every front end - `simulate` and the fleet, `serve` on either executor, `generate`,
`replay-vllm` - resolves its settings (`hybridserve.engine.settings`: preset, then file, then
flags), describes what its model fixes about the cache (`ModelCache`: groups, speculation, DCP
width) and the pool it sized, and `resolve_engine_config` turns those into one frozen
`EngineConfig` (the cache layout with its groups, pool, speculation, retention and in-flight
cap, and the scheduler settings). `build_engine` takes it whole, with an executor factory, and
gives the parts back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hybridserve.core.config import SchedulerConfig, SpeculativeConfig
from hybridserve.core.plan import StepResult
from hybridserve.engine.engine import Engine
from hybridserve.engine.settings import Preset
from hybridserve.executor.api import Executor
from hybridserve.kvcache import CacheLayout, GroupSpec, KVCacheManager
from hybridserve.scheduler import Scheduler, SchedulerOutput
from hybridserve.scheduler.scheduler import RequestOutput

# (settings, cache, draft tokens per step) -> the scheduler over that cache.
SchedulerFactory = Callable[[SchedulerConfig, KVCacheManager, int], Scheduler]
ExecutorFactory = Callable[[CacheLayout], Executor]


@dataclass(frozen=True, slots=True)
class EngineParts:
    """An assembled engine and the parts it was built from (read them, do not rebuild them)."""

    engine: Engine
    scheduler: Scheduler
    cache: KVCacheManager
    layout: CacheLayout


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """One engine, resolved: everything `build_engine` needs but the executor."""

    layout: CacheLayout  # groups, pool, hash block, alignment, DCP, speculation, retention
    scheduler: SchedulerConfig
    enable_caching: bool = True
    # Bounds the token ids the executor may return (a server knows its tokenizer's); None:
    # any id.
    vocab_size: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelCache:
    """What a model and its executor fix about the cache whatever the settings: the groups,
    the speculation, the DCP width and, for a recorded engine, the geometry it ran with
    (0 / None: `CacheLayout`'s own defaults)."""

    groups: tuple[GroupSpec, ...]
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    dcp: int = 1
    hash_block_size: int = 0
    alignment_tokens: int = 0
    eagle_groups: tuple[int, ...] | None = None
    partial_hash_hits: bool = False


def resolve_engine_config(
    settings: Preset,
    model: ModelCache,
    *,
    num_blocks: int,
    vocab_size: int | None = None,
    enable_caching: bool = True,
    max_in_flight_tokens: int | None = None,
    host_blocks: int = 0,
    host_write_through: bool = False,
    host_loads_per_step: int = 0,
) -> EngineConfig:
    """The one engine configuration of a run: the resolved `settings` (scheduler, retention,
    lookahead hashes) over the `model`'s cache and a pool of `num_blocks`.

    * The sliding-window admission cap is one step's token budget (vLLM's synchronous
      scheduler keeps one batch in flight), unless `max_in_flight_tokens` is given (a
      recording of vLLM that logged its own).
    * EAGLE/MTP drop a block instead of hashing a lookahead when the preset says so (`legacy`)
      or the speculation was named that way (`mtp-legacy`).
    * `host_blocks` > 0 adds a host tier of that many blocks (`kvcache/host_tier.py`), filled
      by evictions, or by every computed prompt block with `host_write_through`.
    """
    speculative = model.speculative
    if speculative.uses_hidden_states and not settings.lookahead_block_hashes:
        speculative = replace(speculative, lookahead_block_hashes=False)
    in_flight = max_in_flight_tokens
    if in_flight is None:
        in_flight = settings.scheduler.max_num_batched_tokens
    layout = CacheLayout(
        groups=model.groups,
        num_blocks=num_blocks,
        hash_block_size=model.hash_block_size,
        alignment_tokens=model.alignment_tokens,
        dcp=model.dcp,
        speculative=speculative,
        retention=settings.retention,
        eagle_groups=model.eagle_groups,
        partial_hash_hits=model.partial_hash_hits,
        max_in_flight_tokens=in_flight,
        host_blocks=host_blocks,
        host_write_through=host_write_through,
        host_loads_per_step=host_loads_per_step if host_blocks else 0,
    )
    return EngineConfig(
        layout=layout,
        scheduler=settings.scheduler,
        enable_caching=enable_caching,
        vocab_size=vocab_size,
    )


def build_engine(
    config: EngineConfig,
    executor_factory: ExecutorFactory,
    *,
    scheduler_factory: SchedulerFactory | None = None,
) -> EngineParts:
    """The engine `config` describes over `executor_factory(config.layout)`, called once.
    `scheduler_factory` replaces the plain Scheduler (the simulator's measured-CPU one)."""
    layout = config.layout
    cache = KVCacheManager(layout, enable_caching=config.enable_caching)
    num_drafts = layout.speculative.num_speculative_tokens
    if scheduler_factory is None:
        scheduler = Scheduler(config.scheduler, cache, num_speculative_tokens=num_drafts)
    else:
        scheduler = scheduler_factory(config.scheduler, cache, num_drafts)
    executor = executor_factory(layout)
    engine = Engine(scheduler, executor, vocab_size=config.vocab_size)
    return EngineParts(engine, scheduler, cache, layout)


class CpuMeter:
    """Measures a scheduler's schedule() and update() time with an injected clock, so the
    simulator can add it to the step (`--include-scheduler-cpu`). The clock comes from the
    caller: the engine never reads one itself. Measured time makes a run irreproducible.

    `meter.scheduler` is a SchedulerFactory; `take_s()` returns the time measured since the
    last call (the previous step's update() plus this step's schedule())."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.pending_s = 0.0

    def take_s(self) -> float:
        taken, self.pending_s = self.pending_s, 0.0
        return taken

    def scheduler(
        self, config: SchedulerConfig, cache: KVCacheManager, num_speculative_tokens: int
    ) -> Scheduler:
        return _TimedScheduler(
            config, cache, num_speculative_tokens=num_speculative_tokens, meter=self
        )


class _TimedScheduler(Scheduler):
    """A Scheduler whose schedule() and update() time goes to its CpuMeter."""

    def __init__(
        self,
        config: SchedulerConfig,
        cache: KVCacheManager,
        *,
        num_speculative_tokens: int,
        meter: CpuMeter,
    ) -> None:
        super().__init__(config, cache, num_speculative_tokens=num_speculative_tokens)
        self._meter = meter

    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        start = self._meter.clock()
        out = super().schedule(now)
        self._meter.pending_s += self._meter.clock() - start
        return out

    def update(self, scheduled: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        start = self._meter.clock()
        outputs = super().update(scheduled, result)
        self._meter.pending_s += self._meter.clock() - start
        return outputs
