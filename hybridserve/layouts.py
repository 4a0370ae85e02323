"""Named model cache layouts, and the `--groups` mini-language.

Block sizes are the ones vLLM chooses for the model on one GPU (TP1, bf16): 16 tokens for plain
attention; for hybrids, the attention page is raised until it holds as many bytes as one
recurrent-state page, rounded up to a multiple of 16 tokens, and the state group uses the same
block size. Sources: each model's public Hugging Face `config.json`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridserve.core.errors import ConfigError
from hybridserve.kvcache.spec import (
    ChunkedLocalSpec,
    DraftSpec,
    FullAttentionSpec,
    GroupSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)


@dataclass(frozen=True, slots=True)
class NamedLayout:
    name: str
    groups: tuple[GroupSpec, ...]
    description: str


def _qwen3_next_block_size() -> int:
    # Qwen3-Next-80B-A3B config.json: linear_num_value_heads 32, linear_num_key_heads 16,
    # linear_key_head_dim = linear_value_head_dim = 128, linear_conv_kernel_dim 4;
    # full-attention layers: num_key_value_heads 2, head_dim 256; bf16.
    ssm_state = 32 * 128 * 128
    conv_dim = 16 * 128 * 2 + 32 * 128
    conv_state = conv_dim * (4 - 1)
    state_bytes = (ssm_state + conv_state) * 2
    kv_bytes_per_token = 2 * 2 * 256 * 2  # K and V, 2 KV heads, head_dim 256, bf16
    tokens = -(-state_bytes // kv_bytes_per_token)
    return -(-tokens // 16) * 16  # 536 -> 544


_QWEN3_NEXT_BLOCK = _qwen3_next_block_size()

LAYOUTS: dict[str, NamedLayout] = {
    p.name: p
    for p in (
        NamedLayout(
            "llama-3.1-8b",
            (FullAttentionSpec(block_size=16),),
            "Llama 3.1 8B: 32 full-attention layers (one group), 16-token blocks",
        ),
        NamedLayout(
            "gemma-3-27b",
            (
                SlidingWindowSpec(block_size=16, window=1024),
                FullAttentionSpec(block_size=16),
            ),
            "Gemma 3 27B: 5 sliding-window (1024) layers per global layer, 16-token blocks",
        ),
        NamedLayout(
            "qwen3-next-80b-a3b",
            (
                FullAttentionSpec(block_size=_QWEN3_NEXT_BLOCK),
                MambaSpec(block_size=_QWEN3_NEXT_BLOCK, mode=MambaCacheMode.ALIGN),
            ),
            f"Qwen3-Next 80B-A3B: gated delta net (align mode) + full attention every 4th "
            f"layer, {_QWEN3_NEXT_BLOCK}-token blocks",
        ),
    )
}


def get_layout(name: str) -> NamedLayout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ConfigError("model", name, f"use one of {sorted(LAYOUTS)}") from None


def parse_groups(text: str) -> tuple[GroupSpec, ...]:
    """Parse `full:16,mamba:16`, `full:16,swa:16:w=4096`, `mla:64`, `chunked:16:c=8192`,
    `draft:16:w=2048:extra=2048`, `mamba:16:mode=all`."""
    groups = []
    for item in (part.strip() for part in text.split(",")):
        if item:
            groups.append(_parse_group(item))
    if not groups:
        raise ConfigError("groups", text, "give at least one group, e.g. full:16")
    return tuple(groups)


def _parse_group(item: str) -> GroupSpec:
    kind, *fields = item.split(":")
    if not fields:
        raise ConfigError("groups", item, "write KIND:BLOCK_SIZE[:key=value...], e.g. full:16")
    try:
        block_size = int(fields[0])
        options = dict(_parse_option(item, f) for f in fields[1:])
    except ValueError:
        raise ConfigError("groups", item, "the block size and option values are integers") from None
    allowed = {
        "full": set(),
        "mla": set(),
        "swa": {"w"},
        "draft": {"w", "extra"},
        "chunked": {"c"},
        "mamba": {"mode"},
    }
    if kind not in allowed:
        raise ConfigError("groups", item, f"the kind is one of {sorted(allowed)}")
    unknown = set(options) - allowed[kind]
    if unknown:
        raise ConfigError("groups", item, f"{kind} takes options {sorted(allowed[kind])}")
    required = {"swa": "w", "draft": "w", "chunked": "c"}.get(kind)
    if required and required not in options:
        raise ConfigError("groups", item, f"{kind} needs {required}=N")
    if kind in ("full", "mla"):
        return FullAttentionSpec(block_size=block_size, mla=kind == "mla")
    if kind == "swa":
        return SlidingWindowSpec(block_size=block_size, window=int(options["w"]))
    if kind == "draft":
        extra = int(options.get("extra", "0"))
        return DraftSpec(block_size=block_size, window=int(options["w"]), extra_tokens=extra)
    if kind == "chunked":
        return ChunkedLocalSpec(block_size=block_size, chunk=int(options["c"]))
    mode = options.get("mode", "align")
    if mode not in ("align", "all"):
        raise ConfigError("groups", item, "mamba mode is align or all")
    return MambaSpec(block_size=block_size, mode=MambaCacheMode(mode))


def _parse_option(item: str, text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise ConfigError("groups", item, f"options are key=value, got {text!r}")
    if key != "mode":
        int(value)
    return key, value
