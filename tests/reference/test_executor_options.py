"""Executor options: `--threads` (all cores by default, bad values named), compiled dense
layers giving the same tokens."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hybridserve.cli import app
from hybridserve.core.errors import ConfigError
from hybridserve.executor.torch import load_model
from hybridserve.executor.torch.layers.mlp import GatedMLP
from hybridserve.executor.torch.runner import compile_dense_layers
from hybridserve.executor.torch.runtime import set_threads
from tests.reference.helpers import hybrid_generate, make_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        architectures=["LlamaForCausalLM"],
    )
    path = tmp_path_factory.mktemp("options")
    make_checkpoint(config, path)
    return path


def test_threads_default_to_every_core_the_process_may_use() -> None:
    assert set_threads(None) == len(os.sched_getaffinity(0))
    assert torch.get_num_threads() == len(os.sched_getaffinity(0))
    assert set_threads(1) == 1
    assert torch.get_num_threads() == 1


def test_threads_below_one_are_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match="--threads"):
        set_threads(0)


def test_generate_refuses_zero_threads_before_loading(folder: Path, tmp_path: Path) -> None:
    source = tmp_path / "ids.jsonl"
    source.write_text("[1, 2, 3]\n")
    result = CliRunner().invoke(
        app, ["generate", "--model", str(folder), "--token-ids", str(source), "--threads", "0"]
    )
    assert result.exit_code != 0
    assert "--threads=0" in result.output
    assert "loading" not in result.output


def test_serve_refuses_threads_for_the_simulated_executor() -> None:
    result = CliRunner().invoke(app, ["serve", "--executor", "sim", "--threads", "2"])
    assert result.exit_code != 0
    assert "--threads=2" in result.output


def test_compiled_dense_layers_give_the_same_tokens(folder: Path) -> None:
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    plain = hybrid_generate(folder, prompts, max_tokens=6)
    model = load_model(folder)
    assert compile_dense_layers(model, backend="eager") == 2 * 3 + 1  # 2 MLPs, 5 norms
    mlps = [m for m in model.modules() if isinstance(m, GatedMLP)]
    assert len(mlps) == 2 and all(m._compiled_call_impl is not None for m in mlps)
    compiled = hybrid_generate(model, prompts, max_tokens=6)
    assert compiled.tokens == plain.tokens
