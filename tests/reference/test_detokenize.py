"""Incremental detokenisation with the built-in models' tokenizers: the streamed text equals a
whole decode, stop strings cut exactly across token boundaries, and the work is linear."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hybridserve.server.generation import StopMatcher
from hybridserve.server.tokenizer import OffsetDecoder

MODELS = Path(__file__).resolve().parents[2] / "models"
FILES = {
    "smollm2": MODELS / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m": MODELS / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf",
}
TEXT = "Héllo wörld, 你好 🎉 tabs\tand\nnew lines  two  spaces; the quick brown fox jumps."


@pytest.fixture(scope="module", params=sorted(FILES))
def tokenizer(request: pytest.FixtureRequest) -> Any:
    path = FILES[request.param]
    if not path.is_file():
        pytest.skip(f"{path} is absent: run `make models`")
    from hybridserve.executor.torch.tokenizer import gguf_tokenizer

    return gguf_tokenizer(path)


def _streamed(decode: Callable[[list[int]], str], ids: list[int], rng: random.Random) -> str:
    decoder = OffsetDecoder(decode)
    pieces, i = [], 0
    while i < len(ids):
        size = rng.choice((1, 1, 1, 2, 5))
        pieces.append(decoder.push(ids[i : i + size]))
        i += size
    return "".join(pieces) + decoder.flush()


def test_streamed_text_equals_a_whole_decode(tokenizer: Any) -> None:
    rng = random.Random(0)
    vocab = tokenizer.backend.get_vocab_size()
    cases = [tokenizer.encode(TEXT * 3, add_special_tokens=False)]
    cases += [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(100)]
    cases += [[rng.randrange(300) for _ in range(rng.randint(1, 40))] for _ in range(100)]
    for ids in cases:
        assert _streamed(tokenizer.decode, ids, rng) == tokenizer.decode(ids), ids


@pytest.mark.parametrize("stop", ["own fo", "x jum", "🎉", "lo w", "\n"])
def test_stop_strings_cut_exactly_across_token_boundaries(tokenizer: Any, stop: str) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    decoder, matcher = OffsetDecoder(tokenizer.decode), StopMatcher([stop])
    released, stopped = [], False
    for token in ids:
        out, stopped = matcher.feed(decoder.push([token]), final=False)
        released.append(out)
        if stopped:
            break
    assert stopped
    assert "".join(released) == TEXT[: TEXT.index(stop)]


def test_decoding_work_per_token_stays_flat_from_100_to_8000_tokens(tokenizer: Any) -> None:
    base = tokenizer.encode(TEXT, add_special_tokens=False)

    def work(n: int) -> float:
        decoded = 0

        def counting(ids: list[int]) -> str:
            nonlocal decoded
            decoded += len(ids)
            return str(tokenizer.decode(ids))

        decoder = OffsetDecoder(counting)
        ids = (base * (n // len(base) + 1))[:n]
        for token in ids:
            decoder.push([token])
        decoder.flush()
        return decoded / n

    assert work(8000) < 1.2 * work(100)
