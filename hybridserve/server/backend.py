"""ServingBackend: what `hybridserve serve` needs from a model, and the engine built over it.

A backend owns the model side (tokenizer, cache geometry, the executor); the server owns the
scheduler configuration. Every type in the protocol lives below the server layer, so an
executor package can implement it without importing the server.

`hybridserve serve --executor torch` calls `hybridserve.server.torch_backend.serving_backend(path,
*, name, device, max_model_len, dcp, dcp_interleave)`, where `path` is a checkpoint folder or
GGUF file (the command line resolves a built-in alias such as `smollm2` to its file, and passes
the alias as `name`), `device` is `auto` (CUDA when available), `cpu`, `cuda` or `cuda:N`,
`max_model_len` is None unless `--max-model-len` was given, and `dcp` > 1 starts that many
decode-context-parallel ranks; it returns an object satisfying ServingBackend, with a
`Tokenizer` (server/tokenizer.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from hybridserve.core.config import SchedulerConfig, SpeculativeConfig
from hybridserve.core.plan import StepResult
from hybridserve.engine.assembly import (
    EngineParts,
    ModelCache,
    build_engine,
    resolve_engine_config,
)
from hybridserve.engine.settings import Preset, SettingsSources
from hybridserve.executor.api import Executor
from hybridserve.executor.grammar import Grammars
from hybridserve.kvcache import CacheLayout, GroupSpec
from hybridserve.kvcache.spec import state_quantum
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
    def grammars(self) -> Grammars | None:
        """The tokenizer's structured-output grammars (None: the executor has no tokenizer to
        constrain, and requests for structured output are refused)."""
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

    def num_blocks(self, scheduler: SchedulerConfig) -> int:
        """KV/state blocks that fit in device memory once the weights are loaded, under the
        scheduler settings the engine runs (a pool sized by a profile run depends on them)."""
        ...

    def make_executor(self, layout: CacheLayout) -> Executor:
        """The executor over this cache layout; called once, before serving starts."""
        ...

    def host_tier(self, host_memory_gib: float) -> tuple[int, int]:
        """Set up a host tier of `host_memory_gib` GiB (0: none; called once, before
        `make_executor`): its blocks, and the prefetched loads a step carries at most (0: no
        cap)."""
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

    @property
    def default_max_num_batched_tokens(self) -> int | None:
        """The token budget vLLM's own server defaults to on this backend's device, which
        `serve` takes when neither a flag nor the settings file gives one (None: the preset's).
        """
        ...

    def warm_up(self, num_tokens: int) -> int:
        """Run one untimed step of about `num_tokens` prompt tokens before serving (on the
        engine thread, before its first step): the tokens run, 0 where there is nothing to
        warm (the simulator)."""
        ...


def serve_settings(backend: ServingBackend, sources: SettingsSources) -> Preset:
    """The scheduler settings and retention `serve` runs with: the preset (the flag's, else the
    file's), then the file, then the flags (SchedulerConfig fields; None = not given). The
    scheduler's `max_model_len` is the backend's unless `--max-model-len` says otherwise, and its
    `max_num_batched_tokens` the backend's device default (vLLM's on a CPU: 2,048) where it has
    one and neither `--max-num-batched-tokens` nor the file gives one."""
    given = dict(sources.flags)
    filed = dict(sources.file.scheduler) if sources.file is not None else {}
    extra: list[tuple[str, Any]] = []
    if given.get("max_model_len") is None:
        extra.append(("max_model_len", backend.max_model_len))
    budget = backend.default_max_num_batched_tokens
    key = "max_num_batched_tokens"
    if budget is not None and given.get(key) is None and key not in filed:
        extra.append((key, budget))
    if extra:
        added = dict(extra)
        kept = tuple((k, v) for k, v in sources.flags if k not in added)
        sources = replace(sources, flags=(*kept, *extra))
    return sources.resolve(
        quantum=state_quantum(backend.cache_groups()), max_model_len=backend.max_model_len
    )


def serving_engine(
    backend: ServingBackend,
    settings: Preset,
    *,
    num_blocks: int | None = None,
    host_memory_gib: float = 0.0,
) -> EngineParts:
    """An engine over the backend's executor, configured by `resolve_engine_config` as every
    engine is. `num_blocks` caps the backend's pool size; a token id the executor returns
    outside the tokenizer's vocabulary fails its request. `host_memory_gib` > 0 adds a host
    tier of that size."""
    pool = backend.num_blocks(settings.scheduler)
    model = ModelCache(
        groups=backend.cache_groups(), speculative=backend.speculative, dcp=backend.dcp_width
    )
    host_blocks, loads_per_step = backend.host_tier(host_memory_gib)
    config = resolve_engine_config(
        settings,
        model,
        num_blocks=pool if num_blocks is None else min(num_blocks, pool),
        vocab_size=backend.tokenizer.vocab_size,
        host_blocks=host_blocks,
        host_loads_per_step=loads_per_step,
    )
    return build_engine(config, backend.make_executor)
