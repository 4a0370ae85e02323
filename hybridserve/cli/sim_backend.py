"""The `--executor sim` serving backend: a model profile on a modelled GPU, synthetic tokens.

Text goes through the server's byte-level tokenizer. Sampled ids are folded onto lowercase
letters, space and period so that streamed output is readable ASCII (the simulator's token
values carry no meaning). Each generated token is `<eos>` with probability `eos_probability`
(answers end after a geometric number of tokens, mean 1 / p; 0 = only `max_tokens` or a stop
ends them). A step takes its modelled duration divided by `sim_speed` in wall time;
`sim_speed=1` is real time.
"""

from __future__ import annotations

import random

from hybridserve.core.config import SchedulerConfig, SpeculativeConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import StepPlan, StepResult
from hybridserve.engine.settings import DEFAULT_PRESET
from hybridserve.executor.api import Executor
from hybridserve.kvcache import CacheLayout, GroupSpec
from hybridserve.server.tokenizer import BYTE_EOS_ID, ByteTokenizer
from hybridserve.sim.cost_model import Efficiency
from hybridserve.sim.deployment import DEFAULT_SPECULATIVE_TOKENS, SimConfig, resolve_deployment
from hybridserve.sim.executor import SimulatedExecutor
from hybridserve.sim.host_link import HostLink
from hybridserve.sim.run import (
    StepPricer,
    simulated_cost_model,
    simulated_host_link,
    simulated_pool_blocks,
)

_ALPHABET = b"abcdefghijklmnopqrstuvwxyz ."
_PRINTABLE = frozenset(_ALPHABET)
DEFAULT_MAX_MODEL_LEN = 32_768


def _printable(token: int) -> int:
    # Idempotent, so accepted drafts (already folded) keep their values.
    return token if token in _PRINTABLE else _ALPHABET[token % len(_ALPHABET)]


class PrintableTokens:
    """An executor whose sampled and draft ids are folded onto printable ASCII bytes, and whose
    sampled tokens end the answer (`<eos>`) with probability `eos_probability` each, drawn
    from a generator seeded with `seed`."""

    def __init__(self, inner: Executor, *, eos_probability: float = 0.0, seed: int = 0) -> None:
        if not 0.0 <= eos_probability <= 1.0:
            raise ConfigError("sim_eos_probability", eos_probability, "use a probability in [0, 1]")
        self.inner = inner
        self.eos_probability = eos_probability
        self._rng = random.Random(seed)

    def _with_eos(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        if not self.eos_probability:
            return ids
        for position in range(len(ids)):
            if self._rng.random() < self.eos_probability:
                return (*ids[:position], BYTE_EOS_ID)
        return ids

    def execute(self, plan: StepPlan) -> StepResult:
        result = self.inner.execute(plan)
        sampled = {
            r: self._with_eos(tuple(_printable(t) for t in ids))
            for r, ids in result.sampled_token_ids.items()
        }
        drafts = {r: tuple(_printable(t) for t in ids) for r, ids in result.draft_token_ids.items()}
        return StepResult(result.step_id, sampled, result.duration_s, drafts)


class SimServingBackend:
    """The simulator's deployment (model, GPU, speculation, pool, cost model) as a serving
    backend, resolved by the same functions `simulate` uses (`hybridserve.sim.deployment` and
    `hybridserve.sim.run`), so that `serve --executor sim` and `simulate` build the same engine
    for the same settings."""

    def __init__(
        self,
        *,
        model_profile: str = "qwen3-next-80b-a3b",
        gpu: str = "H200",
        tp: int = 1,
        dtype: str = "fp8",
        kv_dtype: str = "bf16",
        speculation: str = "none",
        num_speculative_tokens: int | None = None,
        acceptance_rate: float = 0.7,
        preset: str = DEFAULT_PRESET,
        seed: int = 0,
        sim_speed: float = 1.0,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        eos_probability: float = 0.0,
        shared_kv: float = 0.0,
    ) -> None:
        if not sim_speed > 0:
            raise ConfigError("sim_speed", sim_speed, "use a factor > 0 (1 = real time)")
        if not 0.0 <= eos_probability <= 1.0:
            raise ConfigError(
                "sim_eos_probability (--sim-eos-probability)",
                eos_probability,
                "use a probability in [0, 1] (0: answers end at max_tokens or a stop)",
            )
        config = SimConfig(
            model=model_profile,
            gpu=gpu,
            tp=tp,
            dtype=dtype,
            kv_dtype=kv_dtype,
            speculation=speculation,
            num_speculative_tokens=num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS,
            acceptance_rate=acceptance_rate,
            preset=preset,
            seed=seed,
            efficiency=_with_shared_kv(shared_kv),
        )
        self.deployment = resolve_deployment(config)  # checks the model, tp and kv_dtype
        self._model = self.deployment.model
        self._gpu = self.deployment.gpu
        self._cost = simulated_cost_model(self.deployment)
        self._speculative = self.deployment.speculative
        self._link: HostLink | None = None
        self._eos_probability = eos_probability
        self._tp, self._dtype = tp, dtype
        self._acceptance_rate = acceptance_rate
        self._seed = seed
        self._sim_speed = sim_speed
        self._max_model_len = max_model_len
        self._tokenizer = ByteTokenizer()

    @property
    def model_name(self) -> str:
        return self._model.name

    @property
    def tokenizer(self) -> ByteTokenizer:
        return self._tokenizer

    @property
    def executor_name(self) -> str:
        return "sim"

    @property
    def description(self) -> str:
        return (
            f"sim: synthetic tokens, {self._model.name} on {self._tp}x simulated "
            f"{self._gpu.name} ({self._dtype}), speculative {self._speculative.method.value}, "
            f"{self._sim_speed:g}x real time, <eos> probability {self._eos_probability:g}"
            + (
                f", shared-prefix reads saved {shared:g}"
                if (shared := self._cost.eff.shared_kv)
                else ""
            )
        )

    @property
    def supports_logprobs(self) -> bool:
        return False  # synthetic tokens come from no distribution

    @property
    def grammars(self) -> None:
        return None  # byte tokens from no model: nothing to constrain

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def speculative(self) -> SpeculativeConfig:
        return self._speculative

    def cache_groups(self) -> tuple[GroupSpec, ...]:
        return self._model.kv_cache_groups()

    def num_blocks(self, scheduler: SchedulerConfig) -> int:
        return simulated_pool_blocks(self.deployment, scheduler)

    @property
    def dcp_width(self) -> int:
        return 1

    def close(self) -> None:
        """Nothing to release: the simulated executor starts no processes."""

    def host_tier(self, host_memory_gib: float) -> tuple[int, int]:
        """The simulated host tier: its blocks per rank and prefetches per step."""
        from dataclasses import replace

        config = replace(self.deployment.config, host_memory_gib=host_memory_gib)
        link, slots = simulated_host_link(replace(self.deployment, config=config))
        self._link = link if slots else None
        return slots, link.loads_per_step() if slots else 0

    def make_executor(self, layout: CacheLayout) -> Executor:
        step_time = StepPricer(self._cost, None, None, {}, self._link)
        step_time.follow(layout)
        return PrintableTokens(
            SimulatedExecutor(
                step_time,
                seed=self._seed,
                vocab_size=256,
                num_speculative_tokens=self._speculative.num_speculative_tokens,
                acceptance_rate=self._acceptance_rate,
            ),
            eos_probability=self._eos_probability,
            seed=self._seed + 1,
        )

    def pace_s(self, result: StepResult) -> float:
        return result.duration_s / self._sim_speed

    @property
    def default_max_num_batched_tokens(self) -> int | None:
        return None  # the preset's: the simulated GPU's vLLM defaults

    def warm_up(self, num_tokens: int) -> int:
        return 0  # simulated steps have no memory to touch


def _with_shared_kv(shared_kv: float) -> Efficiency:
    """The default constants with `shared_kv`. Raises ConfigError naming --sim-shared-kv."""
    try:
        return Efficiency(shared_kv=shared_kv)
    except ConfigError:
        raise ConfigError(
            "sim_shared_kv (--sim-shared-kv)", shared_kv, "use a fraction in [0, 1]"
        ) from None
