"""ServingBackend: what `hybridserve serve` needs from a model, and the engine built over it.

A backend owns the model side (tokenizer, cache geometry, the executor); the server owns the
scheduler configuration. Every type in the protocol lives below the server layer, so an
executor package can implement it without importing the server.

`hybridserve serve --executor torch` calls `hybridserve.cli.torch_serving.serving_backend(model,
*, device, max_model_len, dcp, dcp_interleave)`, where `model` is a built-in alias (`smollm2`,
`gemma3-270m`) or a local checkpoint path, `device` is `auto` (CUDA when available), `cpu`,
`cuda` or `cuda:N`, `max_model_len` is None unless `--max-model-len` was given, and `dcp` > 1
starts that many decode-context-parallel ranks; it
returns an object satisfying ServingBackend, with a `Tokenizer` (server/tokenizer.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from hybridserve.core.config import SchedulerConfig, SpeculativeConfig
from hybridserve.core.plan import StepResult
from hybridserve.engine import Engine
from hybridserve.executor.api import Executor
from hybridserve.kvcache import CacheLayout, GroupSpec, KVCacheManager, RetentionPolicy
from hybridserve.scheduler import Scheduler
from hybridserve.server.tokenizer import Tokenizer


class ServingBackend(Protocol):
    @property
    def model_name(self) -> str:
        """The id clients put in `model` and `/v1/models` lists."""
        ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def description(self) -> str:
        """What runs, in words, for the start-up banner (model, device or simulated GPU)."""
        ...

    @property
    def executor_name(self) -> str:
        """The executor's name as `--executor` spells it (sim, torch), for messages."""
        ...

    @property
    def supports_logprobs(self) -> bool:
        """Whether the executor reports log-probabilities (`SamplingParams.logprobs`,
        `prompt_logprobs`): a real model does, the simulator has none to report."""
        ...

    @property
    def max_model_len(self) -> int:
        """The model's longest context (prompt plus output), in tokens."""
        ...

    @property
    def speculative(self) -> SpeculativeConfig: ...

    def cache_groups(self) -> tuple[GroupSpec, ...]:
        """The model's cache groups (one per layer kind with its own cache spec)."""
        ...

    def num_blocks(self) -> int:
        """KV/state blocks that fit in device memory once the weights are loaded."""
        ...

    def make_executor(self, layout: CacheLayout) -> Executor:
        """The executor over this cache layout; called once, before serving starts."""
        ...

    @property
    def dcp_width(self) -> int:
        """Decode-context-parallel ranks the full-attention KV is sharded over (1 = none): the
        cache then looks up and allocates full attention in `block_size * N` token blocks."""
        ...

    def close(self) -> None:
        """Release what the backend started (DCP ranks); called once the engine stopped."""
        ...

    def pace_s(self, result: StepResult) -> float:
        """Wall seconds a step should take at least: the simulated duration scaled by the
        sim speed for the simulator, 0 for an executor whose steps take real time."""
        ...


@dataclass(frozen=True, slots=True)
class EngineParts:
    engine: Engine
    scheduler: Scheduler
    cache: KVCacheManager


def build_engine(
    backend: ServingBackend,
    scheduler_config: SchedulerConfig,
    *,
    retention: RetentionPolicy,
    num_blocks: int | None = None,
) -> EngineParts:
    """An engine over the backend's executor. `num_blocks` caps the backend's pool size; a
    token id the executor returns outside the tokenizer's vocabulary fails its request."""
    blocks = backend.num_blocks() if num_blocks is None else min(num_blocks, backend.num_blocks())
    layout = CacheLayout(
        groups=backend.cache_groups(),
        num_blocks=blocks,
        speculative=backend.speculative,
        retention=retention,
        dcp=backend.dcp_width,
    )
    cache = KVCacheManager(layout)
    scheduler = Scheduler(
        scheduler_config,
        cache,
        num_speculative_tokens=backend.speculative.num_speculative_tokens,
    )
    executor = backend.make_executor(layout)
    engine = Engine(scheduler, executor, vocab_size=backend.tokenizer.vocab_size)
    return EngineParts(engine, scheduler, cache)
