"""The MTP/EAGLE-style draft head (random weights): greedy output equals plain greedy, a prefix
hit recomputes the dropped tail, and a resume without the head's state is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridserve.core.config import SpeculativeConfig
from hybridserve.engine.engine import StepFailed
from hybridserve.executor.torch.draft_head import MissingDraftState
from tests.reference.helpers import hybrid_generate, make_checkpoint


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("mtp-llama")
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
        architectures=["LlamaForCausalLM"],
    )
    make_checkpoint(config, folder)
    return folder


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(1, 64, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _mtp(folder: Path, prompts: list[list[int]], **options: Any) -> Any:
    return hybrid_generate(folder, prompts, drafts=2, draft_method="mtp", **options)


def test_mtp_head_greedy_output_equals_plain_greedy(llama_folder: Path) -> None:
    prompts = [_prompt(n, seed=n) for n in (5, 14, 27)]
    plain = hybrid_generate(llama_folder, prompts, max_tokens=12, max_num_batched_tokens=9)
    drafted = _mtp(llama_folder, prompts, max_tokens=12, max_num_batched_tokens=9)
    assert drafted.num_drafted_steps > 0
    assert drafted.tokens == plain.tokens


def test_mtp_prefix_hit_recomputes_the_dropped_tail(llama_folder: Path) -> None:
    first = _prompt(24, seed=1)
    prompts = [first, first + _prompt(7, seed=2)]
    plain = hybrid_generate(llama_folder, prompts, max_tokens=8, sequential=True)
    drafted = _mtp(llama_folder, prompts, max_tokens=8, sequential=True)
    # The target hit loses its last alignment unit (4 tokens) so the head sees its hidden state.
    assert 0 < drafted.hit_tokens["r1"] <= plain.hit_tokens["r1"] - 4
    assert drafted.tokens == plain.tokens


def test_resuming_a_drafting_request_without_head_state_is_refused(llama_folder: Path) -> None:
    first = _prompt(24, seed=3)
    answer = hybrid_generate(llama_folder, [first], max_tokens=1).tokens["r0"][0]
    # The second prompt continues the first with another token than the one the head saw.
    prompts = [first, [*first, (answer + 1) % 64, *_prompt(6, seed=4)]]
    no_tail_drop = SpeculativeConfig.from_name("ngram", 2)
    # The engine fails the step's requests and reports the executor's reason as the cause.
    with pytest.raises(StepFailed) as failed:
        _mtp(
            llama_folder,
            prompts,
            max_tokens=4,
            sequential=True,
            layout_options={"speculative": no_tail_drop},
        )
    assert isinstance(failed.value.__cause__, MissingDraftState)
    assert "lookahead block hashes" in str(failed.value.__cause__)
