"""The one place an engine is assembled: cache layout, cache, scheduler, executor, engine.

Every caller - the simulator, the server, the torch runtime, the recordings replay - resolves
one frozen `EngineConfig` (the cache layout with its groups, pool, speculation, retention and
in-flight cap, and the scheduler settings) and hands it whole to `build_engine` with an
executor factory; it gets the parts back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybridserve.core.config import SchedulerConfig
from hybridserve.core.plan import StepResult
from hybridserve.engine.engine import Engine
from hybridserve.executor.api import Executor
from hybridserve.kvcache import CacheLayout, KVCacheManager
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
