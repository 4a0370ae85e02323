"""One simulated run of experiment E1: build the engine from a model, a GPU and a preset, run
the agents, and summarise. The two presets are what `hybridserve bench` compares.

* `baseline`: vLLM behaviour - every scheduler control off, Mamba states retained only at the
  replay boundary (`boundary`).
* `hybridserve`: the shipped controls plus `boundary+predecessor` retention. Provisional values:
  they are to be replaced by the result of a sweep (`hybridserve sweep`, not built yet).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hybridserve.core.config import SchedulerConfig, SpeculativeConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import StepPlan
from hybridserve.engine import Engine, EngineStep
from hybridserve.kvcache import CacheLayout, KVCacheManager, RetentionPolicy
from hybridserve.scheduler import Scheduler
from hybridserve.sim.cost_model import RooflineCostModel, kv_pool_blocks, shape_from_plan
from hybridserve.sim.executor import SimulatedExecutor
from hybridserve.sim.gpus import get_gpu
from hybridserve.sim.loop import AgentSimulation
from hybridserve.sim.models import get_model
from hybridserve.sim.workload import AgentParams, AgentWorkload

PRESETS = ("baseline", "hybridserve")


@dataclass(frozen=True, kw_only=True, slots=True)
class Preset:
    scheduler: SchedulerConfig
    retention: RetentionPolicy


def preset(name: str, *, quantum: int, max_model_len: int) -> Preset:
    """The named configuration; controls in multiples of the quantum (the state block)."""
    if name == "baseline":
        return Preset(
            scheduler=SchedulerConfig(max_model_len=max_model_len),
            retention=RetentionPolicy.parse("boundary"),
        )
    if name == "hybridserve":
        return Preset(
            scheduler=SchedulerConfig(
                max_model_len=max_model_len,
                max_num_prefill_tokens_per_step=4 * quantum,
                max_num_partial_prefills=2,
                decode_prefill_min_decode_steps=2,
                decode_prefill_max_wait_ms=2_000.0,
            ),
            retention=RetentionPolicy.parse("boundary+predecessor"),
        )
    raise ConfigError("preset", name, f"use one of {PRESETS}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    model: str = "qwen3-next-80b-a3b"
    gpu: str = "H200"
    tp: int = 1
    dtype: str = "fp8"
    preset: str = "hybridserve"
    spec: str = "mtp"
    num_speculative_tokens: int = 2
    acceptance_rate: float = 0.7
    duration_s: float = 1_800.0
    warmup_s: float = 300.0
    seed: int = 0
    agents: AgentParams = field(default_factory=AgentParams)

    def __post_init__(self) -> None:
        if self.warmup_s < 0 or self.duration_s <= self.warmup_s:
            raise ConfigError(
                "duration_s", self.duration_s, f"it must exceed warmup_s={self.warmup_s}"
            )


def build_engine(config: SimConfig) -> tuple[Engine, Scheduler]:
    gpu, model = get_gpu(config.gpu), get_model(config.model)
    cost = RooflineCostModel(gpu, model, tp=config.tp, dtype=config.dtype)
    num_blocks = kv_pool_blocks(gpu, model, tp=config.tp, dtype=config.dtype)
    groups = model.cache_groups()
    speculative = SpeculativeConfig.from_name(
        config.spec, config.num_speculative_tokens if config.spec != "none" else 0
    )
    quantum = max((g.block_size for g in groups if g.kind.value == "mamba"), default=1)
    chosen = preset(config.preset, quantum=quantum, max_model_len=config.agents.context_limit + 1)
    layout = CacheLayout(
        groups=groups, num_blocks=num_blocks, speculative=speculative, retention=chosen.retention
    )
    scheduler = Scheduler(
        chosen.scheduler,
        KVCacheManager(layout),
        num_speculative_tokens=speculative.num_speculative_tokens,
    )

    def step_time(plan: StepPlan) -> float:
        return cost.step_cost(shape_from_plan(plan)).total_s

    executor = SimulatedExecutor(
        step_time,
        seed=config.seed,
        num_speculative_tokens=speculative.num_speculative_tokens,
        acceptance_rate=config.acceptance_rate,
    )
    return Engine(scheduler, executor), scheduler


def simulate(
    config: SimConfig, *, progress: Callable[[float], None] | None = None
) -> dict[str, float]:
    """Run E1 and return the summary over [warmup, duration]. `progress(simulated_s)` is
    called after every 256 steps."""
    engine, _ = build_engine(config)
    holder: list[AgentSimulation] = []

    def on_step(step: EngineStep) -> None:
        if progress is not None and holder and holder[0].steps % 256 == 0:
            progress(holder[0].now)

    sim = AgentSimulation(engine, AgentWorkload(config.agents, seed=config.seed), on_step=on_step)
    holder.append(sim)
    recorder = sim.run(config.duration_s)
    summary = recorder.summary(window_start_s=config.warmup_s, window_end_s=config.duration_s)
    summary["steps"] = float(sim.steps)
    summary["simulated_s"] = sim.now
    return summary


def with_preset(config: SimConfig, name: str) -> SimConfig:
    return replace(config, preset=name)
