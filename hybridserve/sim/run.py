"""One simulated run of experiment E1: build the engine from a model, a GPU and a preset, run
the agents, and summarise. The presets (`hybridserve.engine.settings`) are what `hybridserve
bench` compares.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridserve.core.config import SchedulerConfig, SpecMethod, SpeculativeConfig
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
from hybridserve.engine.settings import Preset, preset_uses_lookahead, resolve_settings
from hybridserve.kvcache import CacheLayout
from hybridserve.kvcache.spec import state_quantum as quantum_of_groups
from hybridserve.metrics.recorder import MetricsRecorder
from hybridserve.metrics.stats import percentile
from hybridserve.scheduler import Scheduler
from hybridserve.sim.arrivals import azure_arrivals, mooncake_arrivals, poisson_arrivals
from hybridserve.sim.bounds import (
    bounded_shape,
    check_bound,
    infinite_engine_recorder,
    lifted_budget,
)
from hybridserve.sim.cost_model import (
    Efficiency,
    RooflineCostModel,
    kv_pool_blocks,
    shape_from_plan,
)
from hybridserve.sim.executor import SimulatedExecutor
from hybridserve.sim.fixed_workload import fixed_simulation
from hybridserve.sim.gpus import GpuSpec, get_gpu
from hybridserve.sim.hf_config import load_model_profile
from hybridserve.sim.loop import AgentSimulation, OpenLoopSimulation, Simulation
from hybridserve.sim.memory import (
    KvBudget,
    kv_cache_tokens,
    max_concurrency,
    vllm_kv_budget,
    vllm_log_lines,
)
from hybridserve.sim.mixed_workload import AgentsWithRagSimulation, RagTenant, bursty_simulation
from hybridserve.sim.model_profiles import ModelProfile, get_model
from hybridserve.sim.workload import AgentParams, AgentWorkload

if TYPE_CHECKING:
    from hybridserve.sim.fleet import FleetConfig


DEFAULT_SPECULATIVE_TOKENS = 2  # draft tokens per step (MTP's and EAGLE's k)


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    model: str = "qwen3-next-80b-a3b"
    gpu: str = "H200"
    tp: int = 1
    dtype: str = "fp8"
    preset: str = "hybridserve"
    spec: str = "auto"  # auto: mtp for a model with MTP layers, else none (speculative_method)
    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS
    acceptance_rate: float = 0.7
    duration_s: float = 1_800.0
    warmup_s: float = 300.0
    seed: int = 0
    agents: AgentParams = field(default_factory=AgentParams)
    workload: str = "agents"  # agents | mooncake:PATH | azure:PATH | poisson:rate=R,...
    time_scale: float = 1.0
    limit: int | None = None
    # Scheduler overrides on top of the preset (a sweep trial, a --config file): field -> value.
    controls: tuple[tuple[str, Any], ...] = ()
    retention: str | None = None  # overrides the preset's retention policy
    include_scheduler_cpu: bool = False  # add measured schedule()+update() time to each step
    model_config: str | None = None  # a Hugging Face config.json (or its folder); beats `model`
    kv_dtype: str = "bf16"  # KV cache and recurrent state dtype
    efficiency: Efficiency = field(default_factory=Efficiency)  # cost-model constants
    # A device outside the catalog (a calibration's measured peaks); beats `gpu`.
    gpu_spec: GpuSpec | None = None
    # The context limit; None: the agents' context limit + 1. Longer trace prompts are rejected.
    max_model_len: int | None = None
    # Decode context parallel: full-attention KV sharded over `dcp` of the `tp` ranks (vLLM's
    # DCP reuses the TP ranks), state groups replicated; each rank sizes its own pool.
    dcp: int = 1
    bound: str | None = None  # an upper bound (hybridserve.sim.bounds): free-prefill, ...
    acceptance_decay_per_doubling: float = 0.0  # draft acceptance falling with context
    gpu_memory_utilization: float = 0.9
    # A fleet of replicas behind a router (hybridserve.sim.fleet); None: one engine.
    fleet: FleetConfig | None = None

    def __post_init__(self) -> None:
        if not self.warmup_s >= 0:
            raise ConfigError("warmup_s (--warmup)", self.warmup_s, "use 0 or more seconds")
        if self.duration_s <= self.warmup_s:
            raise ConfigError(
                "duration_s (--duration)",
                self.duration_s,
                f"it must exceed warmup_s={self.warmup_s}: raise it or lower --warmup",
            )
        check_bound(self.bound)
        if self.bound in ("ideal-hits", "infinite-engine") and self.workload != "agents":
            raise ConfigError(
                "bound", self.bound, "this bound needs the agent workload (--workload agents)"
            )
        if self.dcp < 1 or self.tp % self.dcp:
            raise ConfigError(
                "dcp",
                self.dcp,
                f"DCP shards KV over the TP ranks: use a width that divides tp={self.tp} "
                f"(e.g. --tp {max(self.dcp, 1)} --dcp {max(self.dcp, 1)})",
            )
        if self.max_model_len is not None:
            _check_max_model_len(self.max_model_len, self.workload, self.agents)
        if self.fleet is not None and self.bound is not None:
            raise ConfigError(
                "bound (--bound)",
                self.bound,
                "bounds are single-engine: drop --bound (bench: --no-bounds) or the fleet "
                "options (--replicas, --pd)",
            )

    @property
    def context_limit(self) -> int:
        """The scheduler's max_model_len for this run."""
        if self.max_model_len is not None:
            return self.max_model_len
        return self.agents.context_limit + 1


def _check_max_model_len(max_model_len: int, workload: str, agents: AgentParams) -> None:
    if max_model_len < 2:
        raise ConfigError("max_model_len (--max-model-len)", max_model_len, "use 2 or more")
    agentic = workload.partition(":")[0] in ("agents", "agents+rag")
    if agentic and max_model_len <= agents.context_limit:
        raise ConfigError(
            "max_model_len (--max-model-len)",
            max_model_len,
            f"agents grow their contexts to {agents.context_limit} tokens; use more than "
            "that, or a trace workload",
        )


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


def gpu_of(config: SimConfig) -> GpuSpec:
    """The run's device: `gpu_spec` when given, else the catalog entry `gpu`. Raises
    ConfigError for tp > 1 on a device whose interconnect was not measured (link 0)."""
    gpu = config.gpu_spec if config.gpu_spec is not None else get_gpu(config.gpu)
    if config.tp > 1 and gpu.link_bytes_per_s <= 0:
        raise ConfigError(
            "tp", config.tp, f"{gpu.name} has no measured interconnect; simulate it with tp=1"
        )
    return gpu


def state_quantum(model: str | ModelProfile) -> int:
    """The control quantum q of a model: its state block size, or 1 without state groups."""
    profile = get_model(model) if isinstance(model, str) else model
    return quantum_of_groups(profile.cache_groups())


AUTO_SPEC = "auto"
# KV cache and recurrent-state dtypes the cost model and pool sizing express (fp32: a CPU
# calibration). FP4 KV caches are not modelled: their scales and kernels are not.
KV_DTYPES = ("bf16", "fp16", "fp8", "fp32")


def check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in KV_DTYPES:
        raise ConfigError("kv_dtype (--kv-dtype)", kv_dtype, f"use one of {', '.join(KV_DTYPES)}")


def check_tensor_parallel(model: ModelProfile, tp: int) -> None:
    """Tensor parallelism splits every layer's heads evenly over the GPUs, as vLLM requires:
    `tp` must divide the query heads (and the Mamba / gated-delta-net heads); KV heads are split,
    or replicated when there are fewer of them than GPUs (tp a multiple of them)."""
    field = "tp (--tp)"
    if tp < 1:
        raise ConfigError(field, tp, "use 1 or more GPUs")
    heads: list[tuple[str, int]] = []
    if model.attention is not None:
        heads.append(("attention heads", model.attention.num_heads))
    if model.mla is not None:
        heads.append(("MLA heads", model.mla.num_heads))
    recurrent = model.recurrent
    for name in ("num_heads", "num_value_heads", "num_key_heads"):
        count = getattr(recurrent, name, None)
        if isinstance(count, int):
            heads.append((f"{type(recurrent).__name__} {name[4:].replace('_', ' ')}", count))
    for what, count in heads:
        if count % tp:
            divisors = [d for d in range(1, count + 1) if count % d == 0]
            raise ConfigError(
                field,
                tp,
                f"{model.name} has {count} {what}, which {tp} GPUs cannot split "
                f"evenly; use one of {divisors}",
            )
    kv = model.attention.num_kv_heads if model.attention is not None else 0
    if kv and kv < tp and tp % kv:
        raise ConfigError(
            field,
            tp,
            f"{model.name} has {kv} KV heads: use a tp that divides them or that "
            f"they divide (a multiple of {kv})",
        )


def speculative_method(spec: str, model: ModelProfile) -> str:
    """The method a run simulates. `auto` is the model's own: `mtp` when it has MTP layers,
    else `none`. MTP asked of a model without MTP layers is refused: it would simulate
    speculation the model cannot do."""
    if spec == AUTO_SPEC:
        return "mtp" if model.num_mtp_layers > 0 else "none"
    if spec in ("mtp", "mtp-legacy") and model.num_mtp_layers == 0:
        raise ConfigError(
            "spec",
            spec,
            f"{model.name} has no MTP layers; use --spec auto (here: none), none, or a "
            "draft-head method such as eagle",
        )
    return spec


def model_profile(config: SimConfig) -> ModelProfile:
    """The run's model: parsed from `model_config` when given, else the named profile."""
    if config.model_config is not None:
        return load_model_profile(Path(config.model_config))
    return get_model(config.model)


def speculative_of(config: SimConfig) -> SpeculativeConfig:
    """The run's speculation: the model's own method under `auto`; the `legacy` preset takes
    the one-block drop instead of lookahead block hashes."""
    method = speculative_method(config.spec, model_profile(config))
    return SpeculativeConfig.from_name(
        method,
        config.num_speculative_tokens if method != "none" else 0,
        lookahead_block_hashes=preset_uses_lookahead(config.preset),
    )


def draft_passes(speculative: SpeculativeConfig) -> int:
    """Draft forward passes per step the cost model charges: k for MTP and EAGLE-style heads
    (one decoder layer of the target's shape each); other methods are not charged."""
    if speculative.method in (SpecMethod.MTP, SpecMethod.EAGLE, SpecMethod.EAGLE3):
        return speculative.num_speculative_tokens
    return 0


def loaded_model(config: SimConfig) -> ModelProfile:
    """The model as served: its MTP layers (weights, KV) only when it speculates with MTP."""
    return model_profile(config).loaded(mtp=speculative_of(config).method is SpecMethod.MTP)


def scheduler_preset(config: SimConfig, model: ModelProfile) -> Preset:
    """The preset's scheduler and retention with the run's overrides (a `--config` file, a
    sweep trial) applied, in the order every command resolves them."""
    return resolve_settings(
        config.preset,
        quantum=state_quantum(model),
        max_model_len=config.context_limit,
        scheduler=config.controls,
        retention=config.retention,
    )


@dataclass(frozen=True, slots=True)
class Deployment:
    """A run's simulated deployment, resolved once from its `SimConfig`: the model (as named
    and as loaded), the device, the speculation and the scheduler settings. Every engine of
    the run (one, or a fleet's replicas), its pool, its cost model and the serving backend
    are built from it; nothing below re-resolves the model or the preset."""

    config: SimConfig
    profile: ModelProfile  # as named, or parsed from --model-config
    model: ModelProfile  # as served: MTP layers only when it speculates with MTP
    gpu: GpuSpec
    speculative: SpeculativeConfig
    settings: Preset  # the preset, then the file's and the run's overrides


def resolve_deployment(config: SimConfig | Deployment) -> Deployment:
    """The deployment `config` describes (a Deployment is returned as it is)."""
    if isinstance(config, Deployment):
        return config
    profile = model_profile(config)
    method = speculative_method(config.spec, profile)
    speculative = SpeculativeConfig.from_name(
        method,
        config.num_speculative_tokens if method != "none" else 0,
        lookahead_block_hashes=preset_uses_lookahead(config.preset),
    )
    model = profile.loaded(mtp=speculative.method is SpecMethod.MTP)
    check_tensor_parallel(model, config.tp)
    check_kv_dtype(config.kv_dtype)
    return Deployment(
        config=config,
        profile=profile,
        model=model,
        gpu=gpu_of(config),
        speculative=speculative,
        settings=scheduler_preset(config, model),
    )


def pool_budget(config: SimConfig | Deployment) -> KvBudget:
    """One rank's memory account as vLLM's profile run would make it (hybridserve.sim.memory)."""
    deployment = resolve_deployment(config)
    run, scheduler = deployment.config, deployment.settings.scheduler
    return vllm_kv_budget(
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
    budget = pool_budget(deployment)
    groups = deployment.model.kv_cache_groups()
    num_blocks = budget.num_blocks
    return {
        **{k: round(v, 4) for k, v in budget.as_dict().items()},
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
            budget=budget,
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

    def step_time(plan: StepPlan) -> float:
        cpu_s = meter.take_s() if meter is not None else 0.0
        if bound is None:
            shape = shape_from_plan(plan, scheduler_cpu_s=cpu_s)
        else:
            shape = bounded_shape(plan, bound, ideal, scheduler_cpu_s=cpu_s)
        return cost.step_cost(shape).total_s

    def executor(layout: CacheLayout) -> SimulatedExecutor:
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
    )
    return build_engine(
        replace(engine_config, scheduler=scheduler),
        executor,
        scheduler_factory=meter.scheduler if meter is not None else None,
    )


@dataclass(frozen=True, slots=True)
class SimRun:
    """A finished run: the summary over the window, the recorder (samples, timeline) and the
    cache's own counters."""

    config: SimConfig
    summary: dict[str, float]
    recorder: MetricsRecorder
    cache: dict[str, Any]
    rejected: tuple[tuple[str, int, str], ...] = ()  # arrivals refused: id, length, reason
    fleet: dict[str, Any] | None = None  # a fleet's report (hybridserve.sim.fleet.run_fleet)
    notices: tuple[str, ...] = ()  # settings the layout could not take (the scheduler's)

    def ttft_samples_s(self) -> list[float]:
        return self.recorder.ttft_samples_s(self.config.warmup_s, self.config.duration_s)

    def itl_samples_s(self) -> list[float]:
        return self.recorder.itl_samples_s(self.config.warmup_s, self.config.duration_s)


def run_simulation(
    config: SimConfig,
    *,
    progress: Callable[[float], None] | None = None,
    cpu_clock: Callable[[], float] | None = None,
    deployment: Deployment | None = None,
) -> SimRun:
    """Run the workload; `progress(simulated_s)` is called after every 256 steps. With
    `config.fleet`, the workload runs on the fleet (`SimRun.fleet` is its report).
    `deployment`, when the caller resolved it already, is `config`'s (it is not resolved
    again)."""
    if deployment is not None and deployment.config != config:
        raise ConfigError("deployment", "another run's", "resolve it from this config")
    if config.fleet is not None:
        from hybridserve.sim.fleet import run_fleet

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

    def on_step(step: EngineStep) -> None:
        queue.on_step(step.now, step.scheduled.num_waiting)
        if progress is not None and holder and holder[0].steps % 256 == 0:
            progress(holder[0].now)

    sim = make_simulation(config, engine, on_step)
    sim.ideal_prefix = ideal  # the ideal-hits bound's step cost reads what the loop records
    sim.breakdown_from_s = config.warmup_s
    holder.append(sim)
    recorder = sim.run(config.duration_s)
    # A workload that ran out of requests ended early: rates are over the time it had work (as
    # benchmark tools report them), not over an idle tail.
    end_s = sim.now if config.warmup_s < sim.now < config.duration_s else config.duration_s
    summary = recorder.summary(window_start_s=config.warmup_s, window_end_s=end_s)
    _require_completed(summary, config, end_s=end_s, ran_until_s=sim.now)
    summary["steps"] = float(sim.steps)
    summary["simulated_s"] = sim.now
    summary["requests_rejected"] = float(len(sim.rejected))
    summary.update(queue.summary(end_s, recorder))
    summary.update(time_breakdown(recorder, sim.gpu_seconds, ideal, config.warmup_s, end_s))
    cache = scheduler.cache.metrics_snapshot()
    summary.update(group_hit_rates(cache))
    summary["kv_cache_blocks"] = float(scheduler.cache.layout.num_blocks)
    summary.update(pin_counters([scheduler]))
    summary.update(control_counters([scheduler]))
    return SimRun(
        config,
        summary,
        recorder,
        cache,
        rejected=tuple(sim.rejected),
        notices=tuple(scheduler.notices),
    )


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


def pin_counters(schedulers: Sequence[Scheduler]) -> dict[str, float]:
    """Tool-call pinning's counters summed over the engines (none when pinning is off)."""
    out: dict[str, float] = {}
    for scheduler in schedulers:
        if scheduler.pinning:
            for name, value in dataclasses.asdict(scheduler.cache.pin_stats).items():
                out[f"kv_pins_{name}"] = out.get(f"kv_pins_{name}", 0.0) + float(value)
    return out


def control_counters(schedulers: Sequence[Scheduler]) -> dict[str, float]:
    """The adaptive budget's counters summed over the engines (none when it is off): the mixed
    steps planned with its queue valve open, and the budget each engine ended on."""
    out: dict[str, float] = {}
    for scheduler in schedulers:
        adaptive = scheduler.controls.adaptive
        if adaptive is not None:
            for name, value in (
                ("adaptive_queue_pressure_steps", scheduler.controls.stats.queue_pressure_steps),
                ("adaptive_budget_tokens_at_end", adaptive.tokens()),
            ):
                out[name] = out.get(name, 0.0) + float(value)
    return out


def _require_completed(
    summary: dict[str, float], config: SimConfig, *, end_s: float, ran_until_s: float
) -> None:
    """A window in which no request finished has no latency to report: an error, with the fix,
    never a report of nulls."""
    if summary["requests_completed"] > 0:
        return
    raise ConfigError(
        "warmup_s (--warmup)",
        config.warmup_s,
        f"no request finished inside the measurement window [{config.warmup_s:g}, "
        f"{end_s:g}] s (the run had work until {ran_until_s:.1f} s); lower --warmup "
        "(a finite workload's default is 0) or raise --duration",
    )


class QueueTrace:
    """The waiting queue's length through the measurement window, to tell a run that never
    drains (arrivals outpace service, so latency grows with the window) from a steady one."""

    GROWTH = 2.0  # the last quarter's mean queue exceeds GROWTH x the first quarter's, plus
    MIN_WAITING = 8.0  # MIN_WAITING requests: too many to be noise
    # Or, relative to the arrival rate (a queue that saturated before the window opened): while
    # requests arrived, they were served under SERVED x their rate and fell MIN_WAITING behind.
    SERVED = 0.9

    def __init__(self, window_start_s: float) -> None:
        self.window_start_s = window_start_s
        self.samples: list[tuple[float, int]] = []

    def on_step(self, now: float, num_waiting: int) -> None:
        if now >= self.window_start_s:
            self.samples.append((now, num_waiting))

    def summary(self, end_s: float, recorder: MetricsRecorder | None = None) -> dict[str, float]:
        """The queue's first and last quarter means and whether it never drains; with the
        run's `recorder`, also the window's arrival and service rates (requests per second)."""
        span = end_s - self.window_start_s
        first = [w for t, w in self.samples if t < self.window_start_s + span / 4]
        last = [w for t, w in self.samples if self.window_start_s + 3 * span / 4 <= t <= end_s]
        first_mean = sum(first) / len(first) if first else 0.0
        last_mean = sum(last) / len(last) if last else 0.0
        growing = last_mean > self.GROWTH * first_mean + self.MIN_WAITING
        out = {"waiting_first_quarter": first_mean, "waiting_last_quarter": last_mean}
        if recorder is not None:
            rates, backlog = self._rates(recorder, end_s)
            out.update(rates)
            if rates and backlog >= self.MIN_WAITING:
                growing = growing or (
                    rates["service_rate_per_s"] < self.SERVED * rates["arrival_rate_per_s"]
                )
        out["never_drains"] = 1.0 if growing else 0.0
        return out

    def _rates(self, recorder: MetricsRecorder, end_s: float) -> tuple[dict[str, float], int]:
        """The arrival and service rates (requests per second) over the window until its last
        arrival, and the requests left behind then: a finite trace that drains after its
        arrivals end is judged up to its last arrival, not its drain. ({}, 0): too few."""
        start = self.window_start_s
        arrived = [r.arrival_s for r in recorder.requests.values() if start <= r.arrival_s <= end_s]
        last = max(arrived, default=start)
        if len(arrived) < 2 or last <= start:
            return {}, 0
        served = len(recorder.finished_in(start, last))
        span = last - start
        rates = {"arrival_rate_per_s": len(arrived) / span, "service_rate_per_s": served / span}
        return rates, len(arrived) - served


TTFT_SLO_S = 15.0  # the SLO tiers of DESIGN.md section 6: TTFT <= 15 s ...
TBT_SLO_S = 0.100  # ... and time between tokens <= 100 ms (p99 within the turn)


def time_breakdown(
    recorder: MetricsRecorder,
    gpu_seconds: Mapping[str, float],
    ideal_prefix: Mapping[str, int],
    start_s: float,
    end_s: float,
) -> dict[str, float]:
    """Where the time goes over [start_s, end_s]: GPU time by kind of step (fractions of the
    window), job time (jobs finished in the window) in decode, tool wait and queue + TTFT, the
    prompt tokens each turn recomputed against an ideal cache's, and the SLO attainment."""
    window = end_s - start_s
    out = {f"gpu_{kind}_frac": gpu_seconds.get(kind, 0.0) / window for kind in _STEP_KINDS}
    out["gpu_busy_frac"] = sum(out.values())
    jobs = {
        j.job_id: j.finish_s - j.start_s
        for j in recorder.jobs.values()
        if j.finish_s is not None and start_s <= j.finish_s <= end_s
    }
    decode = queue = 0.0
    for r in recorder.requests.values():
        if r.job_id in jobs and r.finish_s is not None and r.first_token_s is not None:
            decode += r.finish_s - r.first_token_s
            queue += r.first_token_s - r.arrival_s
    total = sum(jobs.values())
    out["job_decode_frac"] = decode / total if total else math.nan
    out["job_queue_ttft_frac"] = queue / total if total else math.nan
    out["job_tool_frac"] = (total - decode - queue) / total if total else math.nan
    done = recorder.finished_in(start_s, end_s)
    recomputed = [r.prompt_tokens - r.hit_tokens for r in done]
    ideal = [r.prompt_tokens - ideal_prefix.get(r.req_id, 0) for r in done]
    out["recomputed_prompt_tokens_per_turn"] = statistics.fmean(recomputed) if done else math.nan
    out["ideal_prompt_tokens_per_turn"] = statistics.fmean(ideal) if done else math.nan
    met = [
        r
        for r in done
        if r.first_token_s is not None
        and r.first_token_s - r.arrival_s <= TTFT_SLO_S
        and (not r.gaps_s or percentile(r.gaps_s, 99) <= TBT_SLO_S)
    ]
    out["slo_attainment"] = len(met) / len(done) if done else math.nan
    out.update(slo_goodput(recorder, len(met), start_s, end_s))
    return out


def slo_goodput(
    recorder: MetricsRecorder, requests_met: int, start_s: float, end_s: float
) -> dict[str, float]:
    """Goodput under the SLO over [start_s, end_s]: requests that met both bounds per second,
    and jobs whose inter-token gaps (all of the job's turns together) kept their p99 within the
    ITL bound per hour (a job's turns wait on tools, so its TTFTs are not its user's wait)."""
    gaps: dict[str, list[float]] = {}
    for r in recorder.requests.values():
        if r.job_id is not None:
            gaps.setdefault(r.job_id, []).extend(r.gaps_s)
    jobs_met = sum(
        1
        for j in recorder.jobs.values()
        if j.finish_s is not None
        and start_s <= j.finish_s <= end_s
        and (not gaps.get(j.job_id) or percentile(gaps[j.job_id], 99) <= TBT_SLO_S)
    )
    window = end_s - start_s
    return {
        "slo_requests_per_s": requests_met / window,
        "slo_jobs_per_hour": jobs_met * 3600.0 / window,
    }


_STEP_KINDS = ("decode", "prefill", "mixed")


def group_hit_rates(cache: dict[str, Any]) -> dict[str, float]:
    """Per-group offered hit tokens over queried tokens, over the whole run (the cache counts
    from the start): `group{g}_{kind}_hit_rate`. The reconciled rate is `prefix_hit_rate`."""
    queried = cache["queried_tokens"]
    return {
        f"group{g['group']}_{g['kind']}_hit_rate": g["offered_hit_tokens"] / queried
        if queried
        else 0.0
        for g in cache["groups"]
    }


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
            engine, AgentWorkload(config.agents, seed=config.seed), on_step=on_step
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
