"""One simulated run of experiment E1: build the engine from a model, a GPU and a preset, run
the agents, and summarise. The two presets are what `hybridserve bench` compares.

* `baseline`: vLLM behaviour - every scheduler control off, Mamba states retained only at the
  replay boundary (`boundary`).
* `hybridserve`: the controls the README's selection picked (a sweep screened settings for job
  goodput under a 100 ms p99 ITL SLO, 20 agents, Qwen3-Next on H200; its SLO-meeting leaders
  were rerun on three seeds at full length): Cp = 16 quanta, Mp = 2, D = 4, T = 60 ms (no
  deadline); plus `boundary+predecessor` retention.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hybridserve.core.config import SchedulerConfig, SpecMethod, SpeculativeConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import StepPlan, StepResult
from hybridserve.engine import Engine, EngineStep
from hybridserve.kvcache import CacheLayout, KVCacheManager, RetentionPolicy
from hybridserve.kvcache.spec import state_quantum as quantum_of_groups
from hybridserve.metrics.recorder import MetricsRecorder
from hybridserve.metrics.stats import percentile
from hybridserve.scheduler import Scheduler, SchedulerOutput
from hybridserve.scheduler.scheduler import RequestOutput
from hybridserve.sim.bounds import bounded_shape, check_bound, infinite_engine_recorder
from hybridserve.sim.cost_model import (
    Efficiency,
    RooflineCostModel,
    StepShape,
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
from hybridserve.sim.models import ModelProfile, get_model
from hybridserve.sim.traces import azure_arrivals, mooncake_arrivals, poisson_arrivals
from hybridserve.sim.workload import AgentParams, AgentWorkload

PRESETS = ("baseline", "hybridserve", "controls-only", "retention-only")


@dataclass(frozen=True, kw_only=True, slots=True)
class Preset:
    scheduler: SchedulerConfig
    retention: RetentionPolicy


def preset(name: str, *, quantum: int, max_model_len: int) -> Preset:
    """The named configuration; controls in multiples of the quantum (the state block).

    `controls-only` and `retention-only` are the two ablations of `hybridserve`. A model without
    state groups has q = 1 (SPEC.md 5.2); its mixed-prefill cap is then 8,192 tokens, about
    what 16 quanta are on the hybrid model the preset was selected on (8,704).
    """
    if name not in PRESETS:
        raise ConfigError("preset", name, f"use one of {PRESETS}")
    controls = name in ("hybridserve", "controls-only")
    predecessor = name in ("hybridserve", "retention-only")
    scheduler = SchedulerConfig(max_model_len=max_model_len)
    if controls:
        scheduler = SchedulerConfig(
            max_model_len=max_model_len,
            max_num_prefill_tokens_per_step=16 * quantum if quantum > 1 else 8_192,
            max_num_partial_prefills=2,
            decode_prefill_min_decode_steps=4,
            target_mixed_step_ms=60.0,
        )
    retention = RetentionPolicy.parse("boundary+predecessor" if predecessor else "boundary")
    return Preset(scheduler=scheduler, retention=retention)


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
    # A device outside the catalog (a calibration profile's measured peaks); beats `gpu`.
    gpu_spec: GpuSpec | None = None
    # Decode context parallel: full-attention KV sharded over `dcp` of the `tp` ranks (vLLM's
    # DCP reuses the TP ranks), state groups replicated; each rank sizes its own pool.
    dcp: int = 1
    bound: str | None = None  # an upper bound (hybridserve.sim.bounds): free-prefill, ...
    acceptance_decay_per_doubling: float = 0.0  # draft acceptance falling with context
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.warmup_s < 0 or self.duration_s <= self.warmup_s:
            raise ConfigError(
                "duration_s", self.duration_s, f"it must exceed warmup_s={self.warmup_s}"
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


def model_profile(config: SimConfig) -> ModelProfile:
    """The run's model: parsed from `model_config` when given, else the named profile."""
    if config.model_config is not None:
        return load_model_profile(Path(config.model_config))
    return get_model(config.model)


class TimedScheduler(Scheduler):
    """A Scheduler whose schedule() and update() time is measured with an injected clock, so
    the simulator can add it to the step (`--include-scheduler-cpu`). The clock comes from the
    caller: the simulator itself never reads one. Measured time makes a run irreproducible."""

    def __init__(self, *args: Any, cpu_clock: Callable[[], float], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cpu_clock = cpu_clock
        self.pending_cpu_s = 0.0  # update() of the previous step + schedule() of this one

    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        start = self._cpu_clock()
        out = super().schedule(now)
        self.pending_cpu_s += self._cpu_clock() - start
        return out

    def update(self, scheduled: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        start = self._cpu_clock()
        outputs = super().update(scheduled, result)
        self.pending_cpu_s += self._cpu_clock() - start
        return outputs

    def take_cpu_s(self) -> float:
        taken, self.pending_cpu_s = self.pending_cpu_s, 0.0
        return taken


def speculative_of(config: SimConfig) -> SpeculativeConfig:
    return SpeculativeConfig.from_name(
        config.spec, config.num_speculative_tokens if config.spec != "none" else 0
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
    """The preset's scheduler and retention with the run's overrides applied."""
    quantum = state_quantum(model)
    chosen = preset(config.preset, quantum=quantum, max_model_len=config.agents.context_limit + 1)
    scheduler, retention = chosen.scheduler, chosen.retention
    if config.controls:
        scheduler = replace(scheduler, **dict(config.controls))
    if config.retention is not None:
        retention = RetentionPolicy.parse(config.retention)
    return Preset(scheduler=scheduler, retention=retention)


def pool_budget(config: SimConfig) -> KvBudget:
    """One rank's memory account as vLLM's profile run would make it (hybridserve.sim.memory)."""
    model = loaded_model(config)
    scheduler = scheduler_preset(config, model).scheduler
    return vllm_kv_budget(
        gpu_of(config),
        model,
        tp=config.tp,
        dcp=config.dcp,
        dtype=config.dtype,
        kv_dtype=config.kv_dtype,
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        gpu_memory_utilization=config.gpu_memory_utilization,
    )


def pool_report(config: SimConfig) -> dict[str, Any]:
    """The pool's figures and the lines vLLM would log for it ("GPU KV cache size: N tokens",
    "Maximum concurrency for L tokens per request: Xx"), L = the scheduler's max_model_len."""
    model = loaded_model(config)
    scheduler = scheduler_preset(config, model).scheduler
    budget = pool_budget(config)
    groups = model.kv_cache_groups()
    num_blocks = budget.num_blocks
    return {
        **{k: round(v, 4) for k, v in budget.as_dict().items()},
        "kv_cache_tokens": kv_cache_tokens(num_blocks, groups, dcp=config.dcp),
        "max_concurrency": round(
            max_concurrency(
                num_blocks,
                groups,
                scheduler.max_model_len,
                max_num_batched_tokens=scheduler.max_num_batched_tokens,
                dcp=config.dcp,
            ),
            4,
        ),
        "vllm_log": vllm_log_lines(
            budget=budget,
            num_blocks=num_blocks,
            groups=groups,
            max_model_len=scheduler.max_model_len,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            dcp=config.dcp,
        ),
    }


def build_engine(
    config: SimConfig,
    *,
    cpu_clock: Callable[[], float] | None = None,
    ideal_prefix: Mapping[str, int] | None = None,
) -> tuple[Engine, Scheduler]:
    """The real Engine over a simulated executor. `cpu_clock` is required (and only used) with
    `config.include_scheduler_cpu`; `ideal_prefix` (per request, the prompt tokens an ideal
    cache holds) is what the `ideal-hits` bound reads."""
    if config.bound == "infinite-engine":
        raise ConfigError("bound", config.bound, "an infinite engine has no engine to build")
    gpu, model = gpu_of(config), loaded_model(config)
    speculative = speculative_of(config)
    cost = RooflineCostModel(
        gpu,
        model,
        tp=config.tp,
        dcp=config.dcp,
        dtype=config.dtype,
        kv_dtype=config.kv_dtype,
        efficiency=config.efficiency,
        num_draft_passes=draft_passes(speculative),
    )
    chosen = scheduler_preset(config, model)
    num_blocks = kv_pool_blocks(
        gpu,
        model,
        tp=config.tp,
        dcp=config.dcp,
        dtype=config.dtype,
        kv_dtype=config.kv_dtype,
        max_num_seqs=chosen.scheduler.max_num_seqs,
        max_num_batched_tokens=chosen.scheduler.max_num_batched_tokens,
        gpu_memory_utilization=config.gpu_memory_utilization,
    )
    layout = CacheLayout(
        groups=model.kv_cache_groups(),
        num_blocks=num_blocks,
        speculative=speculative,
        retention=chosen.retention,
        dcp=config.dcp,
    )
    manager = KVCacheManager(layout)
    spec_tokens = speculative.num_speculative_tokens
    bound, ideal = config.bound, ideal_prefix if ideal_prefix is not None else {}

    def shape_of(plan: StepPlan, cpu_s: float) -> StepShape:
        if bound is None:
            return shape_from_plan(plan, scheduler_cpu_s=cpu_s)
        return bounded_shape(plan, bound, ideal, scheduler_cpu_s=cpu_s)

    if config.include_scheduler_cpu:
        if cpu_clock is None:
            raise ConfigError(
                "include_scheduler_cpu", True, "pass a cpu_clock (e.g. time.perf_counter)"
            )
        timed = TimedScheduler(
            chosen.scheduler, manager, num_speculative_tokens=spec_tokens, cpu_clock=cpu_clock
        )

        def step_time(plan: StepPlan) -> float:
            return cost.step_cost(shape_of(plan, timed.take_cpu_s())).total_s

        scheduler: Scheduler = timed
    else:
        scheduler = Scheduler(chosen.scheduler, manager, num_speculative_tokens=spec_tokens)

        def step_time(plan: StepPlan) -> float:
            return cost.step_cost(shape_of(plan, 0.0)).total_s

    executor = SimulatedExecutor(
        step_time,
        seed=config.seed,
        num_speculative_tokens=speculative.num_speculative_tokens,
        acceptance_rate=config.acceptance_rate,
        acceptance_decay_per_doubling=config.acceptance_decay_per_doubling,
    )
    return Engine(scheduler, executor), scheduler


@dataclass(frozen=True, slots=True)
class SimRun:
    """A finished run: the summary over the window, the recorder (samples, timeline) and the
    cache's own counters."""

    config: SimConfig
    summary: dict[str, float]
    recorder: MetricsRecorder
    cache: dict[str, Any]

    def ttft_samples_s(self) -> list[float]:
        return self.recorder.ttft_samples_s(self.config.warmup_s, self.config.duration_s)

    def itl_samples_s(self) -> list[float]:
        return self.recorder.itl_samples_s(self.config.warmup_s, self.config.duration_s)


def run_simulation(
    config: SimConfig,
    *,
    progress: Callable[[float], None] | None = None,
    cpu_clock: Callable[[], float] | None = None,
) -> SimRun:
    """Run the workload; `progress(simulated_s)` is called after every 256 steps."""
    if config.bound == "infinite-engine":
        recorder = infinite_engine_recorder(
            config.agents, seed=config.seed, until_s=config.duration_s
        )
        summary = recorder.summary(window_start_s=config.warmup_s, window_end_s=config.duration_s)
        summary.update(time_breakdown(recorder, {}, {}, config.warmup_s, config.duration_s))
        # No engine, no cache: recomputation is not defined.
        summary["recomputed_prompt_tokens_per_turn"] = math.nan
        summary["ideal_prompt_tokens_per_turn"] = math.nan
        summary["steps"] = 0.0
        summary["simulated_s"] = config.duration_s
        return SimRun(config, summary, recorder, {})
    holder: list[Simulation] = []
    ideal: dict[str, int] = {}
    engine, scheduler = build_engine(config, cpu_clock=cpu_clock, ideal_prefix=ideal)

    def on_step(step: EngineStep) -> None:
        if progress is not None and holder and holder[0].steps % 256 == 0:
            progress(holder[0].now)

    sim = make_simulation(config, engine, on_step)
    sim.ideal_prefix = ideal  # the ideal-hits bound's step cost reads what the loop records
    sim.breakdown_from_s = config.warmup_s
    holder.append(sim)
    recorder = sim.run(config.duration_s)
    end_s = config.duration_s
    if config.workload.startswith("fixed:") and config.warmup_s < sim.now < end_s:
        end_s = sim.now  # a benchmark's rates are over the time it had work, as its tools report
    summary = recorder.summary(window_start_s=config.warmup_s, window_end_s=end_s)
    summary["steps"] = float(sim.steps)
    summary["simulated_s"] = sim.now
    summary.update(time_breakdown(recorder, sim.gpu_seconds, ideal, config.warmup_s, end_s))
    cache = scheduler.cache.metrics_snapshot()
    summary.update(group_hit_rates(cache))
    summary["kv_cache_blocks"] = float(scheduler.cache.layout.num_blocks)
    return SimRun(config, summary, recorder, cache)


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
    return out


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
    scale, limit = config.time_scale, config.limit
    if kind == "mooncake" and arg:
        arrivals = list(mooncake_arrivals(Path(arg), time_scale=scale, limit=limit))
    elif kind == "azure" and arg:
        arrivals = list(azure_arrivals(Path(arg), time_scale=scale, limit=limit))
    elif kind == "poisson":
        arrivals = list(poisson_arrivals(seed=config.seed, **_poisson_options(arg)))
    else:
        raise ConfigError(
            "workload",
            config.workload,
            "use agents, mooncake:PATH, azure:PATH, poisson:rate=R,requests=N,input=I,output=O "
            "or fixed:input=I,output=O,concurrency=C|rate=R[,requests=N]",
        )
    return OpenLoopSimulation(engine, arrivals, on_step=on_step)


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
