"""Random-init checkpoints of a real hybrid architecture and of a same-size dense model, written
with transformers' `save_pretrained`, so that hybridserve, transformers and vLLM load the same
float32 weights from the same files.

The hybrid is Granite 4.0-H's architecture (`GraniteMoeHybridForCausalLM`, the dense-MLP layout
of granite-4.0-h-micro: Mamba2 layers with an attention layer every tenth, at index 5 of each
ten; no positional embedding; one Mamba2 group of state 128; heads of 64; a shared gated MLP 4x
the hidden size; micro's embedding, attention, residual and logits multipliers; tied
embeddings) scaled down to `--shape` (default `0.4b`: hidden 1,024, 20 layers with attention at
5 and 15, 32 Mamba2 heads, 16 query / 4 key-value heads, MLP 4,096: about 0.42B parameters).
The dense model is Llama-style (`LlamaForCausalLM`) with the same hidden size, layer count,
vocabulary, MLP width and heads, every layer attention (RoPE). Both use SmolLM2's tokenizer
(vocabulary 49,152), copied from `models/smollm2-hf` (benchmarks/hf_checkpoint.py writes it).

Weights are transformers' own initialisation (normal with std `initializer_range` 0.02, Mamba2's
A_log = log(1..heads), D = 1, dt_bias = 1) from `torch.manual_seed(--seed)`, so greedy decoding
stays finite. Each folder, `models/NAME-hf/`, is written once and reused while `source.json`
holds the same key (a hash of the config, the seed and the transformers version).

    python benchmarks/hybrid_checkpoint.py [--shape 0.4b] [--seed 0] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybridserve.executor.torch.checkpoints import models_dir

SOURCE_FILE = "source.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# SmolLM2's tokenizer: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2.
SPECIAL_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


@dataclass(frozen=True)
class Shape:
    """The sizes both checkpoints share, and where the hybrid's attention layers sit."""

    hidden_size: int
    num_layers: int
    attention_layers: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    mamba_heads: int  # of (2 * hidden_size / mamba_heads) channels each
    mamba_state: int
    mlp_size: int
    vocab_size: int


SHAPES = {
    # Granite 4.0-H micro (hidden 2,048, 40 layers, attention at 5, 15, 25, 35, MLP 8,192, 64
    # Mamba2 heads, state 128) at half the width and half the depth.
    "0.4b": Shape(1024, 20, (5, 15), 16, 4, 32, 128, 4096, 49152),
    # The same layout at a size the reference tests run in seconds.
    "tiny": Shape(64, 4, (1,), 4, 2, 4, 16, 128, 512),
}


def _widths(shape: Shape) -> dict[str, Any]:
    """The config arguments the hybrid and the dense checkpoint share."""
    return {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
    }


def granite_config(shape: Shape) -> dict[str, Any]:
    """GraniteMoeHybridConfig arguments: granite-4.0-h-micro's settings at `shape`."""
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        **_widths(shape),
        "layer_types": [
            "attention" if i in shape.attention_layers else "mamba" for i in range(shape.num_layers)
        ],
        "intermediate_size": shape.mlp_size,
        "shared_intermediate_size": shape.mlp_size,
        "num_local_experts": 0,
        "num_experts_per_tok": 0,
        "mamba_n_heads": shape.mamba_heads,
        "mamba_d_head": 2 * shape.hidden_size // shape.mamba_heads,
        "mamba_n_groups": 1,
        "mamba_d_state": shape.mamba_state,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 256,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "position_embedding_type": "nope",
        "embedding_multiplier": 12.0,
        "attention_multiplier": 1.0 / (shape.hidden_size // shape.num_heads),
        "residual_multiplier": 0.22,
        "logits_scaling": 8.0,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        **SPECIAL_TOKENS,
    }


def dense_config(shape: Shape) -> dict[str, Any]:
    """LlamaConfig arguments: the same widths and depth, every layer attention."""
    return {
        "architectures": ["LlamaForCausalLM"],
        **_widths(shape),
        "intermediate_size": shape.mlp_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 131072,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        **SPECIAL_TOKENS,
    }


def config_arguments(kind: str, shape: Shape) -> dict[str, Any]:
    """The config's arguments: `kind` is "hybrid" or "dense"."""
    if kind == "hybrid":
        return granite_config(shape)
    if kind == "dense":
        return dense_config(shape)
    raise ValueError(f"kind={kind!r}: use 'hybrid' or 'dense'")


def make_config(kind: str, shape: Shape) -> Any:
    """A transformers config object (GraniteMoeHybridConfig or LlamaConfig)."""
    from transformers import GraniteMoeHybridConfig, LlamaConfig

    config_class = GraniteMoeHybridConfig if kind == "hybrid" else LlamaConfig
    return config_class(**config_arguments(kind, shape))


def folder_name(kind: str, shape_name: str) -> str:
    return f"{'granite4h' if kind == 'hybrid' else 'llama'}-random-{shape_name}-hf"


def source_key(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """What a written folder must match to be reused."""
    import transformers

    text = json.dumps({"config": config, "seed": seed}, sort_keys=True)
    return {
        "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "seed": seed,
        "transformers": transformers.__version__,
    }


def is_current(folder: Path, key: dict[str, Any]) -> bool:
    source = folder / SOURCE_FILE
    if not source.is_file() or not any(folder.glob("*.safetensors")):
        return False
    return bool(json.loads(source.read_text()).get("key") == key)


def count_parameters(model: Any) -> int:
    """Parameters once each (a tied output head is the embedding)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def write_checkpoint(
    kind: str, shape: Shape, folder: Path, *, seed: int = 0, tokenizer: Path | None = None
) -> Path:
    """The `kind` checkpoint at `shape` in `folder` (and the tokenizer files of `tokenizer`),
    unless `folder` already holds it; returns `folder`."""
    import torch
    from transformers import AutoModelForCausalLM

    key = source_key(config_arguments(kind, shape), seed)
    if is_current(folder, key):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(kind, shape), dtype=torch.float32)
    model.eval()
    model.save_pretrained(str(folder))
    if tokenizer is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copyfile(tokenizer / name, folder / name)
    source = {"key": key, "parameters": count_parameters(model), "shape": shape.__dict__}
    (folder / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    return folder


def tokenizer_folder(given: Path | None) -> Path:
    """`given`, else models/smollm2-hf (written from the SmolLM2 GGUF when missing)."""
    if given is not None:
        if not (given / "tokenizer.json").is_file():
            raise SystemExit(
                f"--tokenizer {given}: no tokenizer.json there; give a folder with one"
            )
        return given
    from hf_checkpoint import hf_checkpoint

    try:
        return hf_checkpoint("smollm2")
    except SystemExit as exc:
        raise SystemExit(f"the tokenizer: {exc}; or give --tokenizer DIR") from None


def checkpoints(
    shape_name: str = "0.4b", *, seed: int = 0, tokenizer: Path | None = None
) -> dict[str, Path]:
    """{"hybrid": folder, "dense": folder}, written under models/ if missing or stale."""
    if shape_name not in SHAPES:
        raise SystemExit(f"--shape {shape_name!r}: use one of {sorted(SHAPES)}")
    shape = SHAPES[shape_name]
    folders = {kind: models_dir() / folder_name(kind, shape_name) for kind in ("hybrid", "dense")}
    stale = [
        kind
        for kind, folder in folders.items()
        if not is_current(folder, source_key(config_arguments(kind, shape), seed))
    ]
    # The tokenizer is looked for only when a folder is to be written.
    source = tokenizer_folder(tokenizer) if stale and shape.vocab_size == 49152 else None
    for kind in stale:
        write_checkpoint(kind, shape, folders[kind], seed=seed, tokenizer=source)
    return folders


def parameters(folder: Path) -> int | None:
    source = folder / SOURCE_FILE
    return json.loads(source.read_text()).get("parameters") if source.is_file() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.4b", choices=sorted(SHAPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="folder with tokenizer.json [models/smollm2-hf]",
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    folders = checkpoints(args.shape, seed=args.seed, tokenizer=args.tokenizer)
    print(
        json.dumps(
            {kind: {"folder": str(f), "parameters": parameters(f)} for kind, f in folders.items()}
        )
    )


if __name__ == "__main__":
    main()
