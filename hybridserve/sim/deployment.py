"""A simulated run's configuration (`SimConfig`, with its fleet: `FleetConfig`) and the
deployment resolved from it once (`resolve_deployment`): the model as named and as loaded, the
device, the speculation and the scheduler settings. Every engine of the run, its pool, its cost
model and the serving backend are built from the `Deployment` (`hybridserve.sim.run`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hybridserve.core.config import SpeculativeConfig, SpeculativeMethod
from hybridserve.core.errors import ConfigError
from hybridserve.engine.settings import Preset, preset_uses_lookahead, resolve_settings
from hybridserve.kvcache.spec import FullAttentionSpec, SlidingWindowSpec
from hybridserve.kvcache.spec import state_quantum as quantum_of_groups
from hybridserve.sim.bounds import check_bound
from hybridserve.sim.cost_model import Efficiency
from hybridserve.sim.gpus import Gpu, get_gpu
from hybridserve.sim.hf_config import load_model_profile
from hybridserve.sim.model_profiles import ModelProfile, get_model
from hybridserve.sim.pd import parse_pd
from hybridserve.sim.routers import JUNCTION_WEIGHT, LOAD_WEIGHT, ROUTERS, VIEWS
from hybridserve.sim.workload import AgentParams

DEFAULT_SPECULATIVE_TOKENS = 2  # draft tokens per step (MTP's and EAGLE's k)


@dataclass(frozen=True, kw_only=True, slots=True)
class FleetConfig:
    replicas: int = 1
    router: str = "round-robin"
    view: str = "precise"  # precise | approximate (routers.py)
    load_weight: float = LOAD_WEIGHT  # the prefix routers' load term weight (routers.py)
    # prefix-hybrid's price of a junction token against a hit token (routers.py)
    junction_weight: float = JUNCTION_WEIGHT
    # Prefill/decode disaggregation (pd.py): P prefill and D decode replicas, P + D = replicas.
    pd: tuple[int, int] | None = None
    pd_link: str = "nvlink"

    def __post_init__(self) -> None:
        if self.pd is not None and sum(self.pd) != self.replicas:
            raise ConfigError(
                "replicas (--replicas)",
                self.replicas,
                f"--pd {self.pd[0]}:{self.pd[1]} needs {sum(self.pd)} replicas: give that "
                "or leave --replicas out",
            )
        if self.replicas < 1:
            raise ConfigError("replicas (--replicas)", self.replicas, "use 1 or more replicas")
        if self.router not in ROUTERS:
            raise ConfigError("router (--router)", self.router, f"use one of {', '.join(ROUTERS)}")
        if not self.load_weight >= 0:
            raise ConfigError(
                "load_weight (--router-load-weight)", self.load_weight, "use 0 or more"
            )
        if not 0 <= self.junction_weight <= 1:
            raise ConfigError("junction_weight", self.junction_weight, "use a weight in [0, 1]")
        if self.view not in VIEWS:
            raise ConfigError(
                "router_view (--router-view)", self.view, f"use one of {', '.join(VIEWS)}"
            )


def fleet_of(
    *,
    replicas: int | None,
    router: str = "round-robin",
    view: str = "precise",
    load_weight: float = LOAD_WEIGHT,
    pd: str | None = None,
    pd_link: str = "nvlink",
) -> FleetConfig | None:
    """The fleet the command-line options ask for (`simulate`, `bench` and `sweep` take the
    same): None, one engine, unless `--replicas` or `--pd` is given (`--pd P:D` implies P + D
    replicas). Router or link options without a fleet are an error, not silently ignored."""
    split = None if pd is None else parse_pd(pd)
    if split is not None and replicas is None:
        replicas = sum(split)
    if replicas is None:
        defaults = ("round-robin", "precise", LOAD_WEIGHT, "nvlink")
        if (router, view, load_weight, pd_link) != defaults:
            raise ConfigError(
                "replicas (--replicas)", None, "the --router options need a fleet: add --replicas N"
            )
        return None
    return FleetConfig(
        replicas=replicas,
        router=router,
        view=view,
        load_weight=load_weight,
        pd=split,
        pd_link=pd_link,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    model: str = "qwen3-next-80b-a3b"
    gpu: str = "H200"
    tp: int = 1
    dtype: str = "fp8"
    preset: str = "hybridserve"
    speculation: str = (
        "auto"  # auto: mtp for a model with MTP layers, else none (speculative_method)
    )
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
    overrides: tuple[tuple[str, Any], ...] = ()
    retention: str | None = None  # overrides the preset's retention
    include_scheduler_cpu: bool = False  # add measured schedule()+update() time to each step
    model_config: str | None = None  # a Hugging Face config.json (or its folder); beats `model`
    kv_dtype: str = "bf16"  # KV cache and recurrent state dtype
    efficiency: Efficiency = field(default_factory=Efficiency)  # cost-model constants
    # A device outside the catalog (a calibration's measured peaks); beats `gpu`.
    calibrated_gpu: Gpu | None = None
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
    # vLLM's --block-size for an attention-only model (a real server's pages); None: the
    # profile's. And --num-gpu-blocks-override: the pool in block ids, not sized from memory.
    block_size: int | None = None
    num_gpu_blocks_override: int | None = None
    # What an agent appends after each answer: the engine's tokens ("engine"), or fresh ones
    # ("synthetic") as `hybridserve agents --url` sends, so no turn hits its answer's KV.
    answers: str = "engine"
    # The host tier (hybridserve.sim.host_link): host memory of the engine over its TP ranks,
    # in GiB (0: none), and whether it stores every prompt block once computed (vLLM's
    # offloading connector) instead of what the device evicts.
    host_memory_gib: float = 0.0
    host_write_through: bool = False

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
        if self.answers not in ("engine", "synthetic"):
            raise ConfigError("answers", self.answers, "use engine or synthetic")
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError("block_size (--block-size)", self.block_size, "use 1 or more tokens")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError(
                "num_gpu_blocks_override", self.num_gpu_blocks_override, "use 2 or more blocks"
            )
        if not (self.host_memory_gib >= 0 and math.isfinite(self.host_memory_gib)):
            raise ConfigError(
                "host_memory_gib (--host-memory-gib)", self.host_memory_gib, "use 0 or more GiB"
            )
        if self.host_write_through and self.host_memory_gib == 0:
            raise ConfigError(
                "host_memory_gib (--host-memory-gib)",
                0,
                "vLLM's offloading needs host memory: give --host-memory-gib N",
            )
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


def gpu_of(config: SimConfig) -> Gpu:
    """The run's device: `calibrated_gpu` when given, else the catalog entry `gpu`. Raises
    ConfigError for tp > 1 on a device whose interconnect was not measured (link 0)."""
    gpu = config.calibrated_gpu if config.calibrated_gpu is not None else get_gpu(config.gpu)
    if config.tp > 1 and gpu.link_bytes_per_s <= 0:
        raise ConfigError(
            "tp", config.tp, f"{gpu.name} has no measured interconnect; simulate it with tp=1"
        )
    return gpu


def state_quantum(model: str | ModelProfile) -> int:
    """The control quantum q of a model: its state block size, or 1 without state groups."""
    profile = get_model(model) if isinstance(model, str) else model
    return quantum_of_groups(profile.cache_groups())


AUTO_SPECULATION = "auto"
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


def speculative_method(speculation: str, model: ModelProfile) -> str:
    """The method a run simulates. `auto` is the model's own: `mtp` when it has MTP layers,
    else `none`. MTP asked of a model without MTP layers is refused: it would simulate
    speculation the model cannot do."""
    if speculation == AUTO_SPECULATION:
        return "mtp" if model.num_mtp_layers > 0 else "none"
    if speculation in ("mtp", "mtp-legacy") and model.num_mtp_layers == 0:
        raise ConfigError(
            "spec",
            speculation,
            f"{model.name} has no MTP layers; use --spec auto (here: none), none, or a "
            "draft-head method such as eagle",
        )
    return speculation


def model_profile(config: SimConfig) -> ModelProfile:
    """The run's model: parsed from `model_config` when given, else the named profile; its
    attention pages `config.block_size` tokens when that is set."""
    if config.model_config is not None:
        profile = load_model_profile(Path(config.model_config))
    else:
        profile = get_model(config.model)
    if config.block_size is None:
        return profile
    if any(not isinstance(g, FullAttentionSpec | SlidingWindowSpec) for g in profile.groups):
        raise ConfigError(
            "block_size (--block-size)",
            config.block_size,
            f"{profile.name} has state or draft groups whose pages follow the attention page; "
            "set a block size only for an attention-only model (leave it unset)",
        )
    groups = tuple(replace(g, block_size=config.block_size) for g in profile.groups)
    return replace(profile, groups=groups)


def speculative_of(config: SimConfig) -> SpeculativeConfig:
    """The run's speculation: the model's own method under `auto`; the `legacy` preset takes
    the one-block drop instead of lookahead block hashes."""
    method = speculative_method(config.speculation, model_profile(config))
    return SpeculativeConfig.from_name(
        method,
        config.num_speculative_tokens if method != "none" else 0,
        lookahead_block_hashes=preset_uses_lookahead(config.preset),
    )


def loaded_model(config: SimConfig) -> ModelProfile:
    """The model as served: its MTP layers (weights, KV) only when it speculates with MTP."""
    return model_profile(config).loaded(mtp=speculative_of(config).method is SpeculativeMethod.MTP)


def scheduler_preset(config: SimConfig, model: ModelProfile) -> Preset:
    """The preset's scheduler and retention with the run's overrides (a `--config` file, a
    sweep trial) applied, in the order every command resolves them."""
    return resolve_settings(
        config.preset,
        quantum=state_quantum(model),
        max_model_len=config.context_limit,
        scheduler=config.overrides,
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
    gpu: Gpu
    speculative: SpeculativeConfig
    settings: Preset  # the preset, then the file's and the run's overrides


def resolve_deployment(config: SimConfig | Deployment) -> Deployment:
    """The deployment `config` describes (a Deployment is returned as it is)."""
    if isinstance(config, Deployment):
        return config
    profile = model_profile(config)
    method = speculative_method(config.speculation, profile)
    speculative = SpeculativeConfig.from_name(
        method,
        config.num_speculative_tokens if method != "none" else 0,
        lookahead_block_hashes=preset_uses_lookahead(config.preset),
    )
    model = profile.loaded(mtp=speculative.method is SpeculativeMethod.MTP)
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
