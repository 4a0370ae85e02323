"""The `--executor torch` serving backend: a real model (a checkpoint folder or a GGUF file)
on the TorchExecutor, its tokenizer and chat template behind the server's Tokenizer.

Imported only when `hybridserve serve --executor torch` runs; it imports torch. The command line
resolves a built-in alias (`smollm2`, `gemma3-270m`) to its file and passes the path.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridserve.core.config import SchedulerConfig, SpeculativeConfig
from hybridserve.core.errors import ConfigError
from hybridserve.core.plan import StepResult
from hybridserve.executor.api import Executor
from hybridserve.kvcache import CacheLayout, GroupSpec
from hybridserve.server.tokenizer import ChatMessage, OffsetDecoder

if TYPE_CHECKING:
    from hybridserve.executor.grammar import Grammars
    from hybridserve.executor.torch.dcp import DcpDriver, LocalDcpRanks
    from hybridserve.executor.torch.executor import TorchExecutor
    from hybridserve.executor.torch.tokenizer import TextTokenizer

DEFAULT_MAX_MODEL_LEN = 8_192
DEFAULT_BLOCK_SIZE = 16
# vLLM's default token budget for its OpenAI server on a CPU (`EngineArgs` defaults by device:
# 2,048 a step there, 8,192 on a GPU); `serve` takes it on a CPU unless told otherwise.
CPU_MAX_NUM_BATCHED_TOKENS = 2_048
logger = logging.getLogger(__name__)


class TorchTokenizer:
    """The server's Tokenizer protocol over a checkpoint's (or GGUF's) tokenizer."""

    def __init__(self, text: TextTokenizer, eos_token_ids: tuple[int, ...]) -> None:
        self._text = text
        self._eos = eos_token_ids

    @property
    def vocab_size(self) -> int:
        return int(self._text.backend.get_vocab_size())

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def encode(self, text: str) -> list[int]:
        text.encode("utf-8")  # a lone surrogate raises UnicodeEncodeError, as the protocol says
        return self._text.encode(text)

    @property
    def supports_tools(self) -> bool:
        template = self._text.chat_template
        return template is not None and "tools" in template

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> list[int]:
        for message in messages:
            message.content.encode("utf-8")  # lone surrogates: UnicodeEncodeError
        rendered = self._text.render_chat(
            [m.template_dict() for m in messages], tools=tools, options=options
        )
        # The template writes the special tokens itself.
        return self._text.encode(rendered, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self._text.token_text(token_id)

    def new_decoder(self) -> OffsetDecoder:
        return OffsetDecoder(self._text.decode)


class TorchServingBackend:
    """A loaded model; `make_executor` builds its TorchExecutor over the server's layout."""

    def __init__(
        self,
        path: Path | str,
        *,
        name: str | None = None,
        device: str = "auto",
        max_model_len: int | None = None,
        dcp: int = 1,
        dcp_interleave: int = 1,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
    ) -> None:
        """`name` is the model id clients use (default: the file or folder's name). `dcp` > 1
        starts ranks 1..N-1 as local processes (each loads the model) and makes this process
        rank 0: its engine drives the group; call `close()` after serving. `block_size` is the
        tokens per KV block of every cache group (the pool's and the prefix hits' unit);
        `num_blocks` the pool the executor allocates (default: the bytes of four requests at
        the longest context in every K/V layer, at least 256 blocks' worth, in the executor's
        block ids: `cache.default_pool_blocks`)."""
        from hybridserve.executor.torch.runtime import in_passing_thread, resolve_device

        path = Path(path)
        device = resolve_device(device)
        if dcp < 1 or dcp_interleave < 1:
            raise ConfigError("--dcp", (dcp, dcp_interleave), "use 1 or more (and interleave)")
        if block_size < 1:
            raise ConfigError("--block-size", block_size, "use 1 or more tokens (16, 32, ...)")
        if num_blocks is not None and num_blocks < 2:
            raise ConfigError("--num-blocks", num_blocks, "use 2 or more blocks")
        # Loaded in a thread that then exits, so that the engine thread's OpenMP team is the
        # only one (see in_passing_thread): its steps then run at full speed.
        in_passing_thread(lambda: self._load(path, name, device, max_model_len, dcp,
                                             dcp_interleave, block_size, num_blocks))  # fmt: skip

    def _load(
        self,
        path: Path,
        name: str | None,
        device: str,
        max_model_len: int | None,
        dcp: int,
        dcp_interleave: int,
        block_size: int,
        num_blocks: int | None,
    ) -> None:
        """Load the checkpoint, its tokenizer and grammars, and build the executor (and the
        DCP ranks)."""
        from hybridserve.executor.torch.cache import default_pool_blocks
        from hybridserve.executor.torch.runtime import load_checkpoint

        loaded = load_checkpoint(path)
        if loaded.tokenizer is None:
            raise ConfigError("--model", str(path), "serving text needs a tokenizer.json beside it")
        self._name = name or path.name
        self._source = str(path) if self._name == path.name else f"{self._name} ({path})"
        self._tokenizer = TorchTokenizer(loaded.tokenizer, loaded.stop_token_ids)
        self._max_model_len = max_model_len or DEFAULT_MAX_MODEL_LEN
        # Room for four requests at the longest context unless --num-blocks says; the cache
        # groups come from the model itself, their block size from --block-size. Where the
        # groups share K/V tensors (Gemma 3) the same bytes hold more block ids.
        self._block_size = block_size
        self._num_blocks = num_blocks or default_pool_blocks(
            loaded.model.layer_caches(), max_model_len=self._max_model_len, block_size=block_size
        )
        self._ranks: LocalDcpRanks | None = None
        self._driver: DcpDriver | None = None
        self._grammars = _grammars(loaded.tokenizer, loaded.model, loaded.stop_token_ids)
        if dcp == 1:
            self._executor = self._single_executor(loaded.model, device)
        else:
            self._executor = self._dcp_executor(
                loaded.model, str(path), device, dcp, dcp_interleave
            )

    def _single_executor(self, model: Any, device: str) -> TorchExecutor:
        from hybridserve.executor.torch.executor import TorchExecutor

        return TorchExecutor(
            model,
            num_blocks=self._num_blocks,
            block_size=self._block_size,
            device=device,
            grammars=self._grammars,
        )

    def _dcp_executor(
        self, model: Any, path: str, device: str, dcp: int, interleave: int
    ) -> TorchExecutor:
        """Start ranks 1..dcp-1 and rank 0's executor, driven by a DcpDriver."""
        from hybridserve.executor.torch.dcp import DcpDriver, LocalDcpRanks

        self._ranks = LocalDcpRanks()
        group = self._ranks.start(
            path,
            dcp,
            executor_options={
                "num_blocks": self._num_blocks,
                "block_size": self._block_size,
                "device": device,
                # Every rank samples as rank 0 does, grammars included.
                "grammar_source": self._grammars.source,
            },
            interleave=interleave,
        )
        executor = self._rank_zero_executor(model, device, group)
        self._driver = DcpDriver(executor)
        return executor

    def _rank_zero_executor(self, loaded: Any, device: str, group: Any) -> TorchExecutor:
        """Rank 0's executor; every rank then confirms it started, or all of them stop."""
        from hybridserve.executor.torch.dcp import confirm_ready
        from hybridserve.executor.torch.executor import TorchExecutor

        assert self._ranks is not None
        executor, failure = None, None
        try:
            executor = TorchExecutor(
                loaded,
                num_blocks=self._num_blocks,
                block_size=self._block_size,
                device=device,
                dcp=group,
                grammars=self._grammars,
            )
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
        try:
            confirm_ready(group, failure)
        except RuntimeError as exc:
            self._ranks.close()
            raise ConfigError("--dcp", group.world_size, f"start every rank ({exc})") from None
        assert executor is not None
        return executor

    @property
    def model_name(self) -> str:
        return self._name

    @property
    def tokenizer(self) -> TorchTokenizer:
        return self._tokenizer

    @property
    def executor_name(self) -> str:
        return "torch"

    @property
    def description(self) -> str:
        dcp = self._executor.dcp.world_size
        return (
            f"torch: {self._source} on {self._executor.device}"
            + (f", decode context parallel over {dcp} ranks" if dcp > 1 else "")
            + f", max_model_len={self._max_model_len}"
        )

    @property
    def supports_logprobs(self) -> bool:
        return True

    @property
    def grammars(self) -> Grammars:
        return self._grammars

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def speculative(self) -> SpeculativeConfig:
        return SpeculativeConfig()

    def cache_groups(self) -> tuple[GroupSpec, ...]:
        return self._executor.groups.specs

    def num_blocks(self, scheduler: SchedulerConfig) -> int:
        return self._num_blocks  # the checkpoint's pool: sized at load, whatever the settings

    def host_tier(self, host_memory_gib: float) -> tuple[int, int]:
        """A host pool of `host_memory_gib` GiB beside the executor's, in its block size."""
        if not host_memory_gib >= 0:
            raise ConfigError("--host-memory-gib", host_memory_gib, "use 0 or more GiB")
        if host_memory_gib == 0:
            return 0, 0
        slots = int(host_memory_gib * (1 << 30) // self._executor.block_bytes)
        if slots < 1:
            raise ConfigError(
                "--host-memory-gib",
                host_memory_gib,
                f"it holds no block of {self._executor.block_bytes} bytes; give more, or 0",
            )
        if self._executor.host_cache is None:
            self._executor.enable_host_tier(slots)
        return self._executor.host_blocks, 0

    def make_executor(self, layout: CacheLayout) -> Executor:
        if layout.num_blocks > self._num_blocks:
            raise ConfigError(
                "num_blocks", layout.num_blocks, f"the executor holds {self._num_blocks}"
            )
        executor: Executor = self._driver if self._driver is not None else self._executor
        return executor

    @property
    def dcp_width(self) -> int:
        return self._executor.dcp.world_size

    def pace_s(self, result: StepResult) -> float:
        return 0.0  # real steps take real time

    @property
    def default_max_num_batched_tokens(self) -> int | None:
        """On a CPU, vLLM's own CPU default for its server (2,048 tokens a step, against 8,192
        on a GPU): a step of 8,192 prompt tokens costs 8% more a token than four of 2,048 here
        (Gemma 3 270M, 2 threads: 960 against 888 us), its activations far past the caches."""
        return CPU_MAX_NUM_BATCHED_TOKENS if self._executor.device.type == "cpu" else None

    def warm_up(self, num_tokens: int) -> int:
        """One untimed step of `num_tokens` prompt tokens (`TorchExecutor.warm_up`), run on
        the engine thread before its first step."""
        return self._executor.warm_up(num_tokens)

    def close(self) -> None:
        """Release the DCP ranks, if any (call once the engine thread stopped). A rank that is
        already gone (killed from outside) is reported, not raised: shutdown goes on."""
        if self._driver is not None:
            try:
                self._driver.close()
            except RuntimeError as exc:
                logger.warning("a DCP rank had already stopped; releasing the rest (%s)", exc)
        if self._ranks is not None:
            self._ranks.close()


def _grammars(tokenizer: TextTokenizer, model: Any, stop_token_ids: Sequence[int]) -> Grammars:
    """Structured outputs for the model's tokenizer: masks as wide as its logits, a complete
    output ended by its stop tokens."""
    from hybridserve.executor.grammar import Grammars

    vocab = max(int(model.vocab_size), int(tokenizer.backend.get_vocab_size()))
    return Grammars(tokenizer.backend.to_str(), vocab_size=vocab, eos_token_ids=stop_token_ids)


def serving_backend(
    path: Path,
    *,
    name: str | None = None,
    device: str = "auto",
    max_model_len: int | None = None,
    dcp: int = 1,
    dcp_interleave: int = 1,
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_blocks: int | None = None,
) -> TorchServingBackend:
    return TorchServingBackend(
        path,
        name=name,
        device=device,
        max_model_len=max_model_len,
        dcp=dcp,
        dcp_interleave=dcp_interleave,
        block_size=block_size,
        num_blocks=num_blocks,
    )
