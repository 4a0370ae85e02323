"""Loading a model: a Hugging Face checkpoint folder (config.json + *.safetensors) or a GGUF."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch.models.base import CausalLM, load_model_class


def read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigError("model", str(path), "give a folder with config.json, or a .gguf file")
    config: dict[str, Any] = json.loads(config_path.read_text())
    # Multimodal wrappers keep the language model's settings in text_config.
    text = config.get("text_config")
    if isinstance(text, dict) and "hidden_size" in text:
        merged = {**config, **text}
        merged.setdefault("architectures", config.get("architectures"))
        return merged
    return config


def safetensors_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError("model", str(path), "the folder holds no *.safetensors weights")
    for file in files:
        yield from load_file(str(file)).items()


def build_model(config: dict[str, Any], dtype: torch.dtype = torch.float32) -> CausalLM:
    cls = load_model_class(config)
    return cls(config, dtype).to(dtype)


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32) -> CausalLM:
    """Build the registered model for a checkpoint folder or .gguf file and load its weights."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError("model", str(path), "the path does not exist; give a folder or .gguf")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ConfigError("model", str(path), "give a checkpoint folder or a .gguf file")
        from hybridserve.executor.torch.gguf_loader import load_gguf_model

        return load_gguf_model(path, dtype=dtype)
    model = build_model(read_config(path), dtype)
    model.load_weights(safetensors_weights(path))
    return model
