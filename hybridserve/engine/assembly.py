"""The one place an engine is assembled: cache layout, cache, scheduler, executor, engine.

Every caller - the simulator, the server, the torch runtime, the recordings replay - passes
plain values (the model's cache groups, the pool size, speculation, the resolved scheduler
settings and retention) and an executor factory, and gets the parts back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybridserve.core.config import SchedulerConfig, SpeculativeConfig
from hybridserve.core.plan import StepResult
from hybridserve.engine.engine import Engine
from hybridserve.executor.api import Executor
from hybridserve.kvcache import CacheLayout, GroupSpec, KVCacheManager, RetentionPolicy
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


def build_engine(
    *,
    groups: tuple[GroupSpec, ...],
    num_blocks: int,
    scheduler_config: SchedulerConfig,
    executor_factory: ExecutorFactory,
    retention: RetentionPolicy | None = None,
    speculative: SpeculativeConfig | None = None,
    dcp: int = 1,
    max_in_flight_tokens: int = 0,
    enable_caching: bool = True,
    hash_block_size: int = 0,
    alignment_tokens: int = 0,
    eagle_groups: tuple[int, ...] | None = None,
    partial_hash_hits: bool = False,
    scheduler_factory: SchedulerFactory | None = None,
    vocab_size: int | None = None,
) -> EngineParts:
    """The engine over `executor_factory(layout)`. The layout fields (`groups` ...
    `partial_hash_hits`) are CacheLayout's; `retention` None is CacheLayout's default.
    `scheduler_factory` replaces the plain Scheduler (the simulator's measured-CPU one);
    `vocab_size`, when given, bounds the token ids the executor may return."""
    layout = CacheLayout(
        groups=groups,
        num_blocks=num_blocks,
        hash_block_size=hash_block_size,
        alignment_tokens=alignment_tokens,
        dcp=dcp,
        speculative=speculative if speculative is not None else SpeculativeConfig(),
        retention=retention if retention is not None else RetentionPolicy(),
        eagle_groups=eagle_groups,
        partial_hash_hits=partial_hash_hits,
        max_in_flight_tokens=max_in_flight_tokens,
    )
    cache = KVCacheManager(layout, enable_caching=enable_caching)
    num_drafts = layout.speculative.num_speculative_tokens
    if scheduler_factory is None:
        scheduler = Scheduler(scheduler_config, cache, num_speculative_tokens=num_drafts)
    else:
        scheduler = scheduler_factory(scheduler_config, cache, num_drafts)
    executor = executor_factory(layout)
    engine = Engine(scheduler, executor, vocab_size=vocab_size)
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
