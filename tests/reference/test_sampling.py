"""Seeded sampling through the engine: reproducible per request, independent of the batch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridserve.core.request import SamplingParams
from hybridserve.executor.torch.sampler import (
    greedy_tokens,
    position_seed,
    probabilities,
    verify,
)
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
    first = _sampled(folder, prompt, seed=11, drafts=3)
    assert _sampled(folder, prompt, seed=11, drafts=3) == first


def test_top_k_and_top_p_keep_only_the_allowed_tokens() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    top_k = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top_k[2:] == 0).all() and top_k[:2].sum().item() == pytest.approx(1.0)
    top_p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert top_p[0].item() == pytest.approx(1.0)


@pytest.mark.parametrize("temperature", [0.0, 1e-38, 1e-30, 1e-6, 1e-5, 0.7, 2.0])
@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-38, 0.5, 1.0])
def test_every_accepted_setting_samples_a_token_in_the_vocabulary(
    temperature: float, top_p: float
) -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 30
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=5, seed=1)
    emitted = verify(logits, [4, 9], params, first_position=7)
    assert 1 <= len(emitted) <= 3 and all(0 <= t < 50 for t in emitted)


def test_tiny_temperature_and_top_p_pick_the_top_token() -> None:
    logits = torch.tensor([[0.5, 3.0, 2.9, -1.0]])
    for params in (SamplingParams(temperature=1e-38), SamplingParams(temperature=1, top_p=1e-300)):
        assert verify(logits, [], params, first_position=0) == (1,)


def test_seeds_congruent_mod_2_to_the_62_sample_differently() -> None:
    assert position_seed(5, 10) != position_seed(5 + 2**62, 10)
    logits = torch.zeros(1, 1000)  # uniform: equal draws would mean equal generator states
    params = [SamplingParams(temperature=1.0, seed=s) for s in (5, 5 + 2**62, 5 - 2**62)]
    drawn = [[verify(logits, [], p, first_position=i)[0] for i in range(8)] for p in params]
    assert len({tuple(d) for d in drawn}) == 3


def test_position_seed_is_one_to_one_in_the_seed_at_each_position() -> None:
    seeds = {*range(-500, 500), *(2**63 - 1 - i for i in range(500))}
    seeds |= {k << 40 for k in range(500)}
    for position in (0, 1, 4095):
        assert len({position_seed(s, position) for s in seeds}) == len(seeds)


def test_importing_the_executor_package_and_cli_leaves_torch_out() -> None:
    code = "import sys, hybridserve.executor, hybridserve.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_greedy_tokens_are_argmax_with_its_ties_and_nans() -> None:
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(0))
    logits[0, [17, 4000]] = 50.0  # tied maxima: the first
    logits[1, 3] = float("nan")  # NaN ranks above every number
    logits[1, 9] = 99.0
    logits[2] = -1.0  # every entry tied
    logits[3, [10, 20]] = float("inf")
    assert greedy_tokens(logits).tolist() == torch.argmax(logits, dim=-1).tolist()
    assert greedy_tokens(logits).tolist()[:4] == [17, 3, 0, 10]
