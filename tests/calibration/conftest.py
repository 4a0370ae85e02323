"""Calibration tests run the torch executor on CPU with one thread (CI has two shared cores)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip(
    "torch", reason="the calibration tests need torch (pip install .[test])"
)
pytest.importorskip("safetensors", reason="the calibration tests need safetensors")

torch.set_num_threads(1)

# Llama-style, big enough that weight reads, GEMMs and attention, not the per-step overhead,
# set most step times: about 5M parameters (20 MB in fp32), 4 KB of K/V per token.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="session")
def calib_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model above with seeded random weights, as a checkpoint folder."""
    from safetensors.torch import save_file

    from hybridserve.executor.torch.loader import build_model

    folder = tmp_path_factory.mktemp("calib-llama")
    torch.manual_seed(0)
    model = build_model(CONFIG)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(folder / "model.safetensors"))
    return folder
