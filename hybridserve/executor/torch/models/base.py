"""The model interface: what an architecture implements to run under the TorchExecutor.

How to add an architecture
--------------------------
1. Write `hybridserve/executor/torch/models/<name>.py` with a subclass of `DecoderOnlyLM` (or of
   `CausalLM` for another layout) and decorate it with
   `@register_model("HfArchitectureName", model_types=("hf_model_type",))`. Every module in this
   package is imported by `load_model_class`, so no list needs editing.
2. From the Hugging Face `config.json` dict build `torch.nn` modules whose parameter names equal
   the checkpoint tensor names transformers uses (`model.layers.0.self_attn.q_proj.weight`,
   ...): `load_weights` then needs no mapping. `DecoderOnlyLM` builds the embedding, the final
   norm, the (optionally tied) `lm_head` and the layer loop; a subclass returns its layers from
   `build_layers(config)`. Override `load_weights` (or `checkpoint_renames`) only for genuine
   renames.
3. Implement `layer_caches()`: one `LayerCache` per layer, in layer order:
   * `AttentionCache(num_kv_heads, head_dim, window=None | W)` for full or sliding-window layers;
   * `LatentCache(latent_dim, index_dim)` for an MLA layer (sparse when `index_dim > 0`);
   * `StateCache(shapes={"conv": (...), "ssm": (...)}, dtype=...)` for a recurrent layer
     (Mamba2, gated delta net, short conv). Every tensor is one state of one request.
   The executor groups the layers into cache groups (`derive_cache_groups`: one per kind, or
   vLLM's groups of equal size where full and sliding-window layers mix); the same groups
   configure the real `KVCacheManager`, so cache hits and the tensors always agree.
4. Implement `forward(input_ids, positions, ctx) -> hidden [num_tokens, hidden_size]` over the
   flat batch (all chunks of the step concatenated, in plan order) and `compute_logits(hidden)`.
   Inside a layer, the step's cache is reached only through `ctx: ForwardContext`:
   * attention: `ctx.attention(layer_index, q, k, v, scale=..., softcap=None)` with
     q `[T, num_heads, head_dim]`, k/v `[T, num_kv_heads, head_dim]` (after RoPE). It writes the
     new K/V into the layer's paged cache (block tables from the plan) and attends each token to
     its own request's earlier tokens (inside the window for a sliding layer). Returns
     `[T, num_heads, head_dim]`. Under decode context parallelism (`TorchExecutor(dcp=...)`)
     the same call attends over this rank's shard of a full-attention layer and merges across
     the group; the model does not change.
   * MLA: `ctx.latent_attention(layer_index, q_nope, q_pe, latent, w_uk=, w_uv=, scale=,
     index=None | LatentIndex(...))` caches each token's latent row, attends in the absorbed
     (MQA) form and returns `[T, num_heads, v_head_dim]` before the output projection.
   * recurrent state: `for chunk in ctx.state_chunks(layer_index)` gives each request's row
     slice of the flat batch, `chunk.initial` (a dict of state tensors, zeros for a fresh
     request, else the exact snapshot the cache restored) and `chunk.snapshots`: the token
     counts into the chunk after which the state must be saved. The layer processes the chunk in
     one pass (a chunked scan for prefill, the token loop for decode) that also returns the
     state after each of those counts, and calls `ctx.save_state(layer_index, chunk, n, state)`
     for each. The executor decides where a snapshot goes: in the block the plan's table holds for
     that position (align mode: the state of tokens [0, n) lives in block cdiv(n, block_size)-1
     of the Mamba group's table), or in scratch slots for unverified draft tokens, committed once
     the drafts are verified. A layer never touches block ids.
5. Tests: `tests/reference/helpers.py` has the shared helpers: `make_checkpoint` (a tiny
   random-init transformers model saved as a checkpoint folder), `transformers_greedy` (greedy
   tokens and logits, recomputing with explicit position ids), `hybrid_generate` (the Engine over
   this executor with block size, token budget / chunk size, number of blocks to force
   preemption, sequential requests for prefix hits, n-gram or MTP speculation, sampling) and
   `drop_earlier_kv` (breaks the K/V carry, for meta-tests). A new architecture's reference test
   compares the two on CPU float32; `tests/reference/test_state_snapshots.py` shows a recurrent
   layer against the state interface.

What the executor does around a model: it mirrors block tables from the plan (whole table for a
new request, appended or placed blocks otherwise; see `state_tables.py`), runs copy-on-write
`block_copies`, samples (with the sampling settings the plan carries on a request's first
chunk, `ScheduledChunk.sampling`, kept until the request finishes), verifies drafts, and
proposes the next drafts (n-gram, or the draft head of `draft_head.py`, whose K/V is one more
layer of the full-attention group).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch.layers.norm import RMSNorm
from hybridserve.kvcache.spec import (
    FullAttentionSpec,
    GroupSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)

if TYPE_CHECKING:
    from hybridserve.executor.torch.forward import ForwardContext


@dataclass(frozen=True, slots=True)
class AttentionCache:
    """A layer with paged K/V: full attention (`window=None`) or sliding window of `window`."""

    num_kv_heads: int
    head_dim: int
    window: int | None = None


@dataclass(frozen=True, slots=True)
class LatentCache:
    """An MLA layer (DeepSeek-V2/V3): one latent row `[c_kv | k_pe]` of `latent_dim` per token,
    and for the sparse variant (DeepSeek-V3.2 DSA) one indexer key of `index_dim` per token."""

    latent_dim: int
    index_dim: int = 0


@dataclass(frozen=True, slots=True)
class StateCache:
    """A recurrent layer: one fixed-size state per request, snapshotted at block boundaries."""

    shapes: dict[str, tuple[int, ...]]
    dtype: torch.dtype = torch.float32
    extra: dict[str, Any] = field(default_factory=dict)


LayerCache = AttentionCache | LatentCache | StateCache


@dataclass(frozen=True, slots=True)
class CacheGroups:
    """Cache groups derived from a model's layers; `layer_group[i]` is layer i's group id."""

    specs: tuple[GroupSpec, ...]
    layer_group: tuple[int, ...]

    def layers_of(self, group_id: int) -> tuple[int, ...]:
        return tuple(i for i, g in enumerate(self.layer_group) if g == group_id)


def derive_cache_groups(
    layers: Iterable[LayerCache],
    *,
    block_size: int,
    mamba_mode: MambaCacheMode = MambaCacheMode.ALIGN,
    uniform_pages: bool = True,
) -> CacheGroups:
    """The cache groups of a model's layers. Every group uses `block_size` (state groups share
    the attention page).

    A layer's kind is full attention, sliding window of a given window, MLA or state. With one
    group per kind (`uniform_pages=False`, and always for a model with MLA or state layers, or
    with one kind) the groups come in order of first appearance.

    Otherwise (two or more attention kinds: full and sliding windows) the layers are grouped as
    vLLM's uniform-page grouping does (`kv_cache_utils._get_kv_cache_groups_uniform_page_size`):
    g is the smallest kind's layer count, or the largest when that is under 1.5x the smallest;
    each kind, in order of first appearance, is split into n = ceil(count / g) groups, group i
    taking the kind's layers i, i + n, i + 2n, ... (at most g layers a group: a kind whose
    count is no multiple of g gets smaller ones, which vLLM counts as padded to g). Gemma 3
    270M (15 sliding-window layers, 3 full): 5 sliding-window groups of 3 (layers 0, 6, 12;
    1, 7, 13; ...) and 1 full group (5, 11, 17). Each group allocates its own blocks from the
    one pool, and since a block id belongs to one group at a time, layer k of every group
    keeps its pages in one shared tensor (`DeviceCache`): a block id costs g layers' pages,
    not every layer's.

    A model with state layers (Mamba2, gated delta net) keeps one group per kind: a state
    group's page is one state slot per block id, sized apart from the attention page (the
    block size grows until a page holds a state), and splitting it is not done here. MLA
    models have one kind, and keep their one group."""
    layers = list(layers)
    keys = [_kind(layer) for layer in layers]
    kinds = list(dict.fromkeys(keys))
    members = {kind: [i for i, key in enumerate(keys) if key == kind] for kind in kinds}
    attention_only = all(kind[0] in ("full", "swa") for kind in kinds)
    grouped: list[tuple[tuple[str, int], list[int]]] = []
    if uniform_pages and attention_only and len(kinds) > 1:
        counts = [len(members[kind]) for kind in kinds]
        size = min(counts)
        if max(counts) < size * 1.5:
            size = max(counts)
        for kind in kinds:
            split = -(-len(members[kind]) // size)
            grouped.extend((kind, members[kind][i::split]) for i in range(split))
    else:
        grouped = [(kind, members[kind]) for kind in kinds]
    layer_group = [0] * len(layers)
    specs: list[GroupSpec] = []
    for gid, ((name, window), group_layers) in enumerate(grouped):
        for layer in group_layers:
            layer_group[layer] = gid
        if name in ("full", "mla"):
            specs.append(FullAttentionSpec(block_size=block_size, mla=name == "mla"))
        elif name == "swa":
            specs.append(SlidingWindowSpec(block_size=block_size, window=window))
        else:
            specs.append(MambaSpec(block_size=block_size, mode=mamba_mode))
    return CacheGroups(tuple(specs), tuple(layer_group))


def _kind(layer: LayerCache) -> tuple[str, int]:
    if isinstance(layer, AttentionCache):
        return ("full", 0) if layer.window is None else ("swa", layer.window)
    if isinstance(layer, LatentCache):
        return ("mla", 0)
    return ("state", 0)


class CausalLM(nn.Module):
    """Base class of every model. Subclasses set the modules; see the module docstring."""

    config: dict[str, Any]

    def __init__(self, config: dict[str, Any], dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype

    # ----- what a subclass implements ---------------------------------------------------------

    def layer_caches(self) -> list[LayerCache]:
        """One LayerCache per decoder layer, in layer order."""
        raise NotImplementedError(f"{type(self).__name__} must implement layer_caches()")

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Hidden states `[num_tokens, hidden_size]` after the final norm."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward()")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[n, vocab_size]` for the rows of `hidden`."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute_logits()")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings as the first layer sees them (draft heads reuse them)."""
        raise NotImplementedError(f"{type(self).__name__} must implement embed()")

    # ----- shared behaviour ---------------------------------------------------------------------

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.config.get("eos_token_id")
        if eos is None:
            return ()
        return tuple(int(t) for t in (eos if isinstance(eos, list) else [eos]))

    def checkpoint_renames(self, name: str) -> str | None:
        """Map a checkpoint tensor name to a parameter name; None skips the tensor."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into parameters by name. Raises ConfigError for a missing or
        mis-shaped tensor, naming it. Tied embeddings may omit `lm_head.weight`."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for raw_name, tensor in weights:
            name = self.checkpoint_renames(raw_name)
            if name is None:
                continue
            param = params.get(name)
            if param is None:
                continue  # buffers such as rotary inverse frequencies, or unused heads
            if tuple(param.shape) != tuple(tensor.shape):
                raise ConfigError(
                    f"checkpoint[{raw_name}]",
                    tuple(tensor.shape),
                    f"the model expects shape {tuple(param.shape)}; check config.json",
                )
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            loaded.add(name)
        missing = sorted(set(params) - loaded - self.optional_parameters())
        if missing:
            raise ConfigError(
                "checkpoint",
                f"<{len(missing)} missing tensors, first {missing[0]}>",
                "use a checkpoint saved for this architecture",
            )
        self.tie_weights_after_load()

    def optional_parameters(self) -> set[str]:
        """Parameters a checkpoint may omit (tied output embeddings)."""
        return set()

    def tie_weights_after_load(self) -> None:
        """Called after loading; tie the output embedding here if the config says so."""


class DecoderStack(nn.Module):
    """`model.*` of a decoder-only checkpoint: the input embedding, the layers and the final
    norm, registered in that order under transformers' names."""

    def __init__(
        self,
        embed_tokens: nn.Embedding,
        layers: Iterable[nn.Module],
        norm: nn.Module,
        *,
        norm_name: str,
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm_name = norm_name
        self.add_module(norm_name, norm)

    @property
    def final_norm(self) -> nn.Module:
        return cast(nn.Module, getattr(self, self.norm_name))


class DecoderOnlyLM(CausalLM):
    """A decoder-only model as transformers lays it out: `model.embed_tokens`, `model.layers`
    (each called as `layer(x, positions, ctx)`), the final norm `model.<final_norm_name>` and
    `lm_head`, tied to the input embedding when `tie_word_embeddings` (default
    `tie_embeddings_by_default`) says so.

    A subclass builds its layers in `build_layers(config)` and lists their caches in
    `layer_caches()`; it overrides `embed` or `compute_logits` only for a scale of its own.
    """

    final_norm_name = "norm"
    final_norm_offset = False  # the final norm scales by (1 + weight), as Gemma's do
    tie_embeddings_by_default = False

    def __init__(self, config: dict[str, Any], dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, dtype)
        hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.model = DecoderStack(
            nn.Embedding(vocab, hidden),
            self.build_layers(config),
            RMSNorm(hidden, eps, offset=self.final_norm_offset),
            norm_name=self.final_norm_name,
        )
        self.tied = bool(config.get("tie_word_embeddings", self.tie_embeddings_by_default))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_layers(self, config: dict[str, Any]) -> Iterable[nn.Module]:
        """The decoder layers, in order (`model.layers.<i>`)."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_layers()")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.model.embed_tokens(input_ids))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, ctx)
        return cast(torch.Tensor, self.model.final_norm(x))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def optional_parameters(self) -> set[str]:
        return {"lm_head.weight"} if self.tied else set()

    def checkpoint_renames(self, name: str) -> str | None:
        if self.tied and name == "lm_head.weight":
            return None
        return name


ModelClass = type[CausalLM]
_BY_ARCHITECTURE: dict[str, ModelClass] = {}
_BY_MODEL_TYPE: dict[str, ModelClass] = {}


def register_model(
    *architectures: str, model_types: tuple[str, ...] = ()
) -> Callable[[ModelClass], ModelClass]:
    """Class decorator: make `cls` the implementation of HF `architectures` / `model_types`."""

    def wrap(cls: ModelClass) -> ModelClass:
        for name in architectures:
            _BY_ARCHITECTURE[name] = cls
        for name in model_types:
            _BY_MODEL_TYPE[name] = cls
        return cls

    return wrap


def _import_all_models() -> None:
    package = importlib.import_module("hybridserve.executor.torch.models")
    for info in pkgutil.iter_modules(package.__path__):
        if info.name != "base":
            importlib.import_module(f"{package.__name__}.{info.name}")


def load_model_class(config: dict[str, Any]) -> ModelClass:
    """The registered class for a config.json dict, by `architectures` then `model_type`."""
    _import_all_models()
    for name in config.get("architectures") or ():
        if name in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[name]
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise ConfigError(
        "config.architectures",
        config.get("architectures") or model_type,
        f"use a supported architecture: {sorted(_BY_ARCHITECTURE)} "
        f"(model_type {sorted(_BY_MODEL_TYPE)})",
    )
