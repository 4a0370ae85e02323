"""Seeded sampling through the engine: reproducible per request, independent of the batch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridserve.core.request import SamplingParams
from hybridserve.executor.torch.sampler import probabilities
from tests.reference.helpers import hybrid_generate, make_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("sampling-llama")
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        architectures=["LlamaForCausalLM"],
    )
    make_checkpoint(config, path)
    return path


def _sampled(
    folder: Path, prompts: list[list[int]], seed: int, **options: object
) -> list[list[int]]:
    params = SamplingParams(
        max_tokens=12, temperature=1.0, top_p=0.9, top_k=20, seed=seed, ignore_eos=True
    )
    run = hybrid_generate(folder, prompts, sampling=params, **options)  # type: ignore[arg-type]
    return [run.tokens[f"r{i}"] for i in range(len(prompts))]


def test_seeded_sampling_does_not_depend_on_the_batch(folder: Path) -> None:
    alone = _sampled(folder, [[1, 2, 3, 4]], seed=5)
    batched = _sampled(
        folder, [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3]], seed=5, max_num_batched_tokens=3
    )
    assert batched[0] == alone[0]
    assert _sampled(folder, [[1, 2, 3, 4]], seed=6) != alone


def test_seeded_sampling_with_ngram_drafts_is_reproducible(folder: Path) -> None:
    prompt = [[4, 5, 6, 7] * 3]
    first = _sampled(folder, prompt, seed=11, spec_tokens=3)
    assert _sampled(folder, prompt, seed=11, spec_tokens=3) == first


def test_top_k_and_top_p_keep_only_the_allowed_tokens() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    top_k = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top_k[2:] == 0).all() and top_k[:2].sum().item() == pytest.approx(1.0)
    top_p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert top_p[0].item() == pytest.approx(1.0)


def test_importing_the_executor_package_and_cli_leaves_torch_out() -> None:
    code = "import sys, hybridserve.executor, hybridserve.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
