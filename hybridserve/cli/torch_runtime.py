"""Assembling an Engine over the TorchExecutor from a model path (torch is imported lazily)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hybridserve.core.config import SchedulerConfig, SpeculativeConfig
from hybridserve.core.errors import ConfigError
from hybridserve.engine.engine import Engine
from hybridserve.kvcache import KVCacheManager
from hybridserve.scheduler import Scheduler

if TYPE_CHECKING:
    from hybridserve.executor.torch.runner import TorchExecutor
    from hybridserve.executor.torch.tokenizer import TextTokenizer


@dataclass
class TorchRuntime:
    engine: Engine
    executor: TorchExecutor
    tokenizer: TextTokenizer | None
    stop_token_ids: tuple[int, ...]


def parse_spec(text: str | None) -> SpeculativeConfig:
    """`ngram:K` (K draft tokens) or None for no speculation."""
    if not text:
        return SpeculativeConfig()
    method, _, count = text.partition(":")
    if method != "ngram":
        raise ConfigError("--spec", text, "use ngram:K, e.g. ngram:3")
    try:
        k = int(count) if count else 3
    except ValueError:
        raise ConfigError("--spec", text, "K is a positive integer, e.g. ngram:3") from None
    if k < 1:
        raise ConfigError("--spec", text, "K is a positive integer, e.g. ngram:3")
    return SpeculativeConfig.from_name("ngram", k)


def build_runtime(
    model_path: Path,
    *,
    num_blocks: int,
    block_size: int = 16,
    device: str = "cpu",
    speculative: SpeculativeConfig | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 32768,
    load_tokenizer: bool = True,
) -> TorchRuntime:
    """Load the model (and its tokenizer) and wire scheduler, cache and executor together."""
    import torch

    from hybridserve.executor.torch.gguf_file import GGUFFile
    from hybridserve.executor.torch.loader import load_model
    from hybridserve.executor.torch.runner import TorchExecutor
    from hybridserve.executor.torch.tokenizer import gguf_tokenizer
    from hybridserve.executor.torch.tokenizer import load_tokenizer as folder_tokenizer

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device", device, "CUDA is not available here; use cpu")
    speculative = speculative or SpeculativeConfig()
    tokenizer = None
    if model_path.is_file() and model_path.suffix == ".gguf":
        from hybridserve.executor.torch.gguf_loader import load_gguf_model

        file = GGUFFile(model_path)
        model = load_gguf_model(model_path, file=file)
        tokenizer = gguf_tokenizer(model_path, file) if load_tokenizer else None
    else:
        model = load_model(model_path)
        tokenizer = folder_tokenizer(model_path) if load_tokenizer else None
    executor = TorchExecutor(
        model,
        num_blocks=num_blocks,
        block_size=block_size,
        device=device,
        speculative=speculative,
        max_num_seqs=max_num_seqs,
    )
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
    )
    scheduler = Scheduler(
        config,
        KVCacheManager(executor.cache_layout()),
        num_speculative_tokens=speculative.num_speculative_tokens,
    )
    stops = set(model.eos_token_ids())
    if tokenizer is not None:
        for name in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>"):
            token_id = tokenizer.backend.token_to_id(name)
            if token_id is not None:
                stops.add(int(token_id))
    return TorchRuntime(Engine(scheduler, executor), executor, tokenizer, tuple(sorted(stops)))


def blocks_for(lengths: list[int], *, max_tokens: int, block_size: int, num_groups: int) -> int:
    """Enough blocks for every request to be resident at once, plus slack."""
    per_group = sum(-(-(n + max_tokens + block_size) // block_size) for n in lengths)
    return max(64, per_group * num_groups + 16)
