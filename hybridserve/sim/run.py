"""One simulated run of experiment E1: build the engines of a run's deployment
(`hybridserve.sim.deployment`), run the workload on one engine or on a fleet, and summarise
(`hybridserve.sim.summary`). The presets (`hybridserve.engine.settings`) are what
`hybridserve bench` compares.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridserve.core.config import SchedulerConfig, SpeculativeConfig, SpeculativeMethod
from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import StepPlan
from hybridserve.engine import Engine, EngineStep
from hybridserve.engine.assembly import (
    CpuMeter,
    EngineParts,
    ModelCache,
    build_engine,
    resolve_engine_config,
)
from hybridserve.engine.shared_kv import DecodeSharing
from hybridserve.engine.step_log import StepLog
from hybridserve.kvcache import CacheLayout
from hybridserve.sim.arrivals import azure_arrivals, mooncake_arrivals, poisson_arrivals
from hybridserve.sim.bounds import (
    bounded_shape,
    infinite_engine_recorder,
    lifted_budget,
)
from hybridserve.sim.cost_model import (
    RooflineCostModel,
    kv_pool_blocks,
    shape_from_plan,
)
from hybridserve.sim.deployment import Deployment, FleetConfig, SimConfig, resolve_deployment
from hybridserve.sim.executor import SimulatedExecutor
from hybridserve.sim.fixed_workload import fixed_simulation
from hybridserve.sim.fleet import FleetSimulation
from hybridserve.sim.fleet_report import FleetRun, fleet_run
from hybridserve.sim.host_link import HostLink, host_blocks
from hybridserve.sim.loop import AgentSimulation, OpenLoopSimulation, Simulation
from hybridserve.sim.memory import (
    MemoryAccount,
    bytes_per_block,
    kv_cache_tokens,
    max_concurrency,
    vllm_log_lines,
    vllm_memory_account,
)
from hybridserve.sim.mixed_workload import AgentsWithRagSimulation, RagTenant, bursty_simulation
from hybridserve.sim.summary import (
    QueueTrace,
    SimRun,
    engine_counters,
    time_breakdown,
    window_end_s,
    window_summary,
)
from hybridserve.sim.workload import AgentWorkload

if TYPE_CHECKING:
    from hybridserve.metrics.recorder import MetricsRecorder
    from hybridserve.scheduler.scheduler import Scheduler

# Workloads that run out of requests: their warm-up defaults to 0 (finite_workload).
_FINITE_KINDS = ("mooncake", "azure", "poisson")


def finite_workload(workload: str) -> bool:
    """True for a workload with a fixed number of requests (a trace, poisson, or fixed with
    requests=N), which may end long before a 300 s warm-up; agents and an open-ended fixed or
    bursty workload run for the whole duration."""
    kind, _, arg = workload.partition(":")
    if kind in ("fixed", "bursty"):
        return any(item.startswith("requests=") for item in arg.split(","))
    return kind in _FINITE_KINDS


def draft_passes(speculative: SpeculativeConfig) -> int:
    """Draft forward passes per step the cost model charges: k for MTP and EAGLE-style heads
    (one decoder layer of the target's shape each); other methods are not charged."""
    if speculative.method in (
        SpeculativeMethod.MTP,
        SpeculativeMethod.EAGLE,
        SpeculativeMethod.EAGLE3,
    ):
        return speculative.num_speculative_tokens
    return 0


def pool_memory_account(config: SimConfig | Deployment) -> MemoryAccount:
    """One rank's memory account as vLLM's profile run would make it (hybridserve.sim.memory)."""
    deployment = resolve_deployment(config)
    run, scheduler = deployment.config, deployment.settings.scheduler
    return vllm_memory_account(
        deployment.gpu,
        deployment.model,
        tp=run.tp,
        dcp=run.dcp,
        dtype=run.dtype,
        kv_dtype=run.kv_dtype,
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        gpu_memory_utilization=run.gpu_memory_utilization,
    )


def pool_report(config: SimConfig | Deployment) -> dict[str, Any]:
    """The pool's figures and the lines vLLM would log for it ("GPU KV cache size: N tokens",
    "Maximum concurrency for L tokens per request: Xx"), L = the scheduler's max_model_len."""
    deployment = resolve_deployment(config)
    scheduler, dcp = deployment.settings.scheduler, deployment.config.dcp
    account = pool_memory_account(deployment)
    groups = deployment.model.kv_cache_groups()
    num_blocks = deployment.config.num_gpu_blocks_override or account.num_blocks
    return {
        **{k: round(v, 4) for k, v in account.as_dict().items()},
        "kv_cache_tokens": kv_cache_tokens(num_blocks, groups, dcp=dcp),
        "max_concurrency": round(
            max_concurrency(
                num_blocks,
                groups,
                scheduler.max_model_len,
                max_num_batched_tokens=scheduler.max_num_batched_tokens,
                dcp=dcp,
            ),
            4,
        ),
        "vllm_log": vllm_log_lines(
            account=account,
            num_blocks=num_blocks,
            groups=groups,
            max_model_len=scheduler.max_model_len,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            dcp=dcp,
        ),
    }


def simulated_cost_model(config: SimConfig | Deployment) -> RooflineCostModel:
    """The cost model of the run's deployment (GPU, model as loaded, TP, DCP, dtypes, the
    draft passes its speculation charges): what every simulated engine's steps cost."""
    deployment = resolve_deployment(config)
    run = deployment.config
    return RooflineCostModel(
        deployment.gpu,
        deployment.model,
        tp=run.tp,
        dcp=run.dcp,
        dtype=run.dtype,
        kv_dtype=run.kv_dtype,
        efficiency=run.efficiency,
        num_draft_passes=draft_passes(deployment.speculative),
    )


def simulated_pool_blocks(config: SimConfig | Deployment, scheduler: SchedulerConfig) -> int:
    """The blocks the deployment's pool holds under `scheduler` (vLLM's profile run sizes its
    activations by max_num_seqs and max_num_batched_tokens)."""
    deployment = resolve_deployment(config)
    run = deployment.config
    if run.num_gpu_blocks_override is not None:
        return run.num_gpu_blocks_override
    return kv_pool_blocks(
        deployment.gpu,
        deployment.model,
        tp=run.tp,
        dcp=run.dcp,
        dtype=run.dtype,
        kv_dtype=run.kv_dtype,
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        gpu_memory_utilization=run.gpu_memory_utilization,
    )


def simulated_host_link(deployment: SimConfig | Deployment) -> tuple[HostLink, int]:
    """The deployment's host link and its host tier's blocks per rank (0: no tier)."""
    resolved = resolve_deployment(deployment)
    run = resolved.config
    per_block = bytes_per_block(resolved.model, tp=run.tp, kv_dtype=run.kv_dtype, dcp=run.dcp)
    slots = host_blocks(run.host_memory_gib, per_block, tp=run.tp)
    return HostLink.of(resolved.gpu, per_block), slots


class StepPricer:
    """A simulated step's seconds: its plan priced by the cost model (under a step-cost bound,
    the work the bound still charges), plus the host link's transfers where there is a tier;
    `follow(layout)` has it count shared decode reads where the constants price them."""

    def __init__(
        self,
        cost: RooflineCostModel,
        meter: CpuMeter | None,
        bound: str | None,
        ideal: Mapping[str, int],
        link: HostLink | None,
    ) -> None:
        self.cost, self.meter, self.bound, self.ideal, self.link = cost, meter, bound, ideal, link
        self.sharing: DecodeSharing | None = None

    def follow(self, layout: CacheLayout) -> None:
        """Follow the block tables of `layout`'s engine, where `shared_kv` prices sharing."""
        self.sharing = DecodeSharing.of(layout) if self.cost.eff.shared_kv > 0 else None

    def __call__(self, plan: StepPlan) -> float:
        cpu_s = self.meter.take_s() if self.meter is not None else 0.0
        if self.bound is None:
            shared = self.sharing.shared_kv_tokens(plan) if self.sharing is not None else 0
            shape = shape_from_plan(plan, scheduler_cpu_s=cpu_s, shared_kv_tokens=shared)
        else:
            shape = bounded_shape(plan, self.bound, self.ideal, scheduler_cpu_s=cpu_s)
        total = self.cost.step_cost(shape).total_s
        return total + self.link.step_s(plan, total) if self.link is not None else total


def simulated_engine(
    deployment: SimConfig | Deployment,
    *,
    cpu_clock: Callable[[], float] | None = None,
    ideal_prefix: Mapping[str, int] | None = None,
) -> EngineParts:
    """The real Engine over a simulated executor. `cpu_clock` is required (and only used) with
    `config.include_scheduler_cpu`; `ideal_prefix` (per request, the prompt tokens an ideal
    cache holds) is what the `ideal-hits` bound reads."""
    resolved = resolve_deployment(deployment)
    config = resolved.config
    if config.bound == "infinite-engine":
        raise ConfigError("bound", config.bound, "an infinite engine has no engine to build")
    model, speculative, chosen = resolved.model, resolved.speculative, resolved.settings
    cost = simulated_cost_model(resolved)
    num_blocks = simulated_pool_blocks(resolved, chosen.scheduler)
    link, num_host_blocks = simulated_host_link(resolved)
    bound, ideal = config.bound, ideal_prefix if ideal_prefix is not None else {}
    # Under a step-cost bound the prompt tokens it makes free take no token budget either
    # (the pool above is still the one the real budget's profile run leaves).
    scheduler = lifted_budget(chosen.scheduler, speculative) if bound else chosen.scheduler
    meter: CpuMeter | None = None
    if config.include_scheduler_cpu:
        if cpu_clock is None:
            raise ConfigError(
                "include_scheduler_cpu", True, "pass a cpu_clock (e.g. time.perf_counter)"
            )
        meter = CpuMeter(cpu_clock)

    step_time = StepPricer(cost, meter, bound, ideal, link if num_host_blocks else None)

    def executor(layout: CacheLayout) -> SimulatedExecutor:
        step_time.follow(layout)
        return SimulatedExecutor(
            step_time,
            seed=config.seed,
            num_speculative_tokens=layout.speculative.num_speculative_tokens,
            acceptance_rate=config.acceptance_rate,
            acceptance_decay_per_doubling=config.acceptance_decay_per_doubling,
        )

    engine_config = resolve_engine_config(
        chosen,
        ModelCache(groups=model.kv_cache_groups(), speculative=speculative, dcp=config.dcp),
        num_blocks=num_blocks,
        host_blocks=num_host_blocks,
        host_write_through=config.host_write_through,
        host_loads_per_step=link.loads_per_step(),
    )
    return build_engine(
        replace(engine_config, scheduler=scheduler),
        executor,
        scheduler_factory=meter.scheduler if meter is not None else None,
    )


def check_step_log(config: SimConfig, path: object) -> None:
    """Refuse a step log (`path`; None: none) for a run that is not one engine's steps."""
    if path is not None and (config.fleet is not None or config.bound == "infinite-engine"):
        raise ConfigError(
            "step_log (--step-log)",
            str(path),
            "a step log follows one engine: drop the fleet options or the infinite-engine bound",
        )


def _check_run(config: SimConfig, deployment: Deployment | None, step_log: StepLog | None) -> None:
    if deployment is not None and deployment.config != config:
        raise ConfigError("deployment", "another run's", "resolve it from this config")
    check_step_log(config, step_log.path if step_log is not None else None)


def run_simulation(
    config: SimConfig,
    *,
    progress: Callable[[float], None] | None = None,
    cpu_clock: Callable[[], float] | None = None,
    deployment: Deployment | None = None,
    step_log: StepLog | None = None,
) -> SimRun:
    """Run the workload; `progress(simulated_s)` is called after every 256 steps. With
    `config.fleet`, the workload runs on the fleet (`SimRun.fleet` is its report).
    `deployment`, when the caller resolved it already, is `config`'s (it is not resolved
    again). `step_log` gets every step that scheduled work (one engine only)."""
    _check_run(config, deployment, step_log)
    if config.fleet is not None:
        return run_fleet(
            config, config.fleet, progress=progress, cpu_clock=cpu_clock, deployment=deployment
        ).run
    if config.bound == "infinite-engine":
        return _infinite_engine_run(config)
    holder: list[Simulation] = []
    queue = QueueTrace(config.warmup_s)
    ideal: dict[str, int] = {}
    parts = simulated_engine(deployment or config, cpu_clock=cpu_clock, ideal_prefix=ideal)
    engine, scheduler = parts.engine, parts.scheduler
    if step_log is not None:
        step_log.follow(parts.layout)

    def on_step(step: EngineStep) -> None:
        queue.on_step(step.now, step.scheduled.num_waiting)
        if step_log is not None:  # the loop charges at least a microsecond a step
            step_log.write(step, start_s=step.now, duration_s=max(step.result.duration_s, 1e-6))
        if progress is not None and holder and holder[0].steps % 256 == 0:
            progress(holder[0].now)

    sim = make_simulation(config, engine, on_step)
    sim.ideal_prefix = ideal  # the ideal-hits bound's step cost reads what the loop records
    sim.breakdown_from_s = config.warmup_s
    holder.append(sim)
    recorder = sim.run(config.duration_s)
    return _finished_run(config, sim, recorder, scheduler, queue, ideal)


def _finished_run(
    config: SimConfig,
    sim: Simulation,
    recorder: MetricsRecorder,
    scheduler: Scheduler,
    queue: QueueTrace,
    ideal: Mapping[str, int],
) -> SimRun:
    """The SimRun of one engine's finished simulation: the window's summary and the cache's
    counters."""
    summary = window_summary(
        recorder,
        config,
        end_s=window_end_s(config, sim.now),
        ran_until_s=sim.now,
        steps=sim.steps,
        rejected=sim.rejected,
        jobs_failed=sim.jobs_failed,
        queue=queue,
        gpu_seconds=sim.gpu_seconds,
        ideal_prefix=ideal,
    )
    cache = scheduler.cache.metrics_snapshot()
    summary.update(engine_counters(cache, [scheduler]))
    return SimRun(
        config,
        summary,
        recorder,
        cache,
        rejected=tuple(sim.rejected),
        notices=tuple(scheduler.notices),
    )


def fleet_simulation(
    config: SimConfig,
    fleet: FleetConfig,
    *,
    progress: Callable[[float], None] | None = None,
    cpu_clock: Callable[[], float] | None = None,
    deployment: Deployment | None = None,
) -> FleetSimulation:
    """The fleet's loop, ready to run: `fleet.replicas` engines built from the run's deployment
    (resolved once; `deployment` when the caller has it), driving `config`'s workload."""
    if config.bound is not None:
        raise ConfigError("bound (--bound)", config.bound, "bounds are single-engine: drop --bound")
    resolved = deployment or resolve_deployment(config)
    ideal: dict[str, int] = {}
    replicas = [
        simulated_engine(resolved, cpu_clock=cpu_clock, ideal_prefix=ideal)
        for _ in range(fleet.replicas)
    ]
    workload = make_simulation(config, replicas[0].engine, lambda _s: None)
    workload.ideal_prefix = ideal
    return FleetSimulation(resolved, fleet, replicas, workload, progress=progress)


def run_fleet(
    config: SimConfig,
    fleet: FleetConfig,
    *,
    progress: Callable[[float], None] | None = None,
    cpu_clock: Callable[[], float] | None = None,
    deployment: Deployment | None = None,
) -> FleetRun:
    """Run the workload on the fleet; the summary has the single-engine keys, fleet-wide."""
    config = replace(config, fleet=fleet)
    if deployment is not None:
        deployment = replace(deployment, config=config)
    sim = fleet_simulation(
        config, fleet, progress=progress, cpu_clock=cpu_clock, deployment=deployment
    )
    sim.run(config.duration_s)
    return fleet_run(sim)


def _infinite_engine_run(config: SimConfig) -> SimRun:
    """The infinite-engine bound: every request served at once, no engine and no cache."""
    recorder = infinite_engine_recorder(config.agents, seed=config.seed, until_s=config.duration_s)
    summary = recorder.summary(window_start_s=config.warmup_s, window_end_s=config.duration_s)
    summary.update(time_breakdown(recorder, {}, {}, config.warmup_s, config.duration_s))
    # No engine, no cache: recomputation is not defined.
    summary["recomputed_prompt_tokens_per_turn"] = math.nan
    summary["ideal_prompt_tokens_per_turn"] = math.nan
    summary["steps"] = 0.0
    summary["simulated_s"] = config.duration_s
    return SimRun(config, summary, recorder, {})


def simulate(
    config: SimConfig,
    *,
    progress: Callable[[float], None] | None = None,
    cpu_clock: Callable[[], float] | None = None,
) -> dict[str, float]:
    """Run the workload and return the summary over [warmup, duration]."""
    return run_simulation(config, progress=progress, cpu_clock=cpu_clock).summary


def make_simulation(
    config: SimConfig, engine: Engine, on_step: Callable[[EngineStep], None]
) -> Simulation:
    """The simulation for `config.workload`."""
    kind, _, arg = config.workload.partition(":")
    if kind == "agents":
        return AgentSimulation(
            engine,
            AgentWorkload(config.agents, seed=config.seed),
            synthetic_answers=config.answers == "synthetic",
            on_step=on_step,
        )
    if kind == "fixed":
        return fixed_simulation(
            arg, engine, duration_s=config.duration_s, seed=config.seed, on_step=on_step
        )
    if kind == "bursty":
        return bursty_simulation(
            arg, engine, duration_s=config.duration_s, seed=config.seed, on_step=on_step
        )
    if kind == "agents+rag":
        return AgentsWithRagSimulation(
            engine,
            AgentWorkload(config.agents, seed=config.seed),
            RagTenant.parse(arg),
            duration_s=config.duration_s,
            seed=config.seed,
            on_step=on_step,
        )
    # A trace prompt the engine would refuse is refused (and reported) before it is built.
    rejected: list[tuple[str, int, str]] = []
    loaders = {"mooncake": mooncake_arrivals, "azure": azure_arrivals}
    if kind in loaders and arg:
        arrivals = list(
            loaders[kind](
                Path(arg),
                time_scale=config.time_scale,
                limit=config.limit,
                max_prompt_tokens=engine.scheduler.config.max_model_len,
                rejected=rejected,
            )
        )
    elif kind == "poisson":
        arrivals = list(poisson_arrivals(seed=config.seed, **_poisson_options(arg)))
    else:
        raise ConfigError(
            "workload",
            config.workload,
            "use agents, mooncake:PATH, azure:PATH, poisson:rate=R,requests=N,input=I,output=O, "
            "fixed:input=I,output=O,concurrency=C|rate=R[,requests=N], "
            "bursty:rate=R,on=S,off=S,input=I,output=O or agents+rag:rate=R,input=I,output=O",
        )
    sim = OpenLoopSimulation(engine, arrivals, on_step=on_step)
    sim.rejected.extend(rejected)
    return sim


def _poisson_options(text: str) -> dict[str, Any]:
    names = {
        "rate": "rate_per_s",
        "requests": "num_requests",
        "input": "input_tokens",
        "output": "output_tokens",
    }
    options: dict[str, Any] = {
        "rate_per_s": 1.0,
        "num_requests": 100,
        "input_tokens": 1024,
        "output_tokens": 128,
    }
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in names:
            raise ConfigError("workload", item, f"poisson takes {sorted(names)}")
        try:
            options[names[key]] = float(value) if key == "rate" else int(value)
        except ValueError:
            raise ConfigError("workload", item, "give numbers, e.g. rate=2") from None
    return options


def with_preset(config: SimConfig, name: str) -> SimConfig:
    return replace(config, preset=name)
