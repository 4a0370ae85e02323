"""`hybridserve serve --executor torch` on a tiny random Llama checkpoint with a word-level
tokenizer: the OpenAI client gets the same greedy text as transformers, streamed or not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch executor needs the torch extra")
pytest.importorskip("transformers", reason="the reference model comes from transformers")
tokenizers = pytest.importorskip("tokenizers", reason="the checkpoint's tokenizer")

from openai import OpenAI  # noqa: E402

from hybridserve.cli.serve_commands import build_app  # noqa: E402
from hybridserve.server.app import ServerSettings  # noqa: E402
from tests.e2e.conftest import LiveServer, serve_in_thread  # noqa: E402

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "on",
    "mat",
    "ran",
    "to",
    "park",
    "and",
    "then",
    "slept",
    "ate",
    "fish",
    "bird",
    "sang",
    "tree",
]
SPECIALS = ["<unk>", "<s>", "</s>", "<user>", "<assistant>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _write_checkpoint(folder: Path) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig

    from tests.reference.helpers import make_checkpoint

    vocab = {t: i for i, t in enumerate([*SPECIALS, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"})
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        tie_word_embeddings=False,
    )
    return make_checkpoint(config, folder), tok


@pytest.fixture(scope="module")
def torch_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Any]]:
    from hybridserve.cli.torch_serving import TorchServingBackend

    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("tiny-llama")
    reference, tok = _write_checkpoint(folder)
    backend = TorchServingBackend(str(folder), device="cpu", max_model_len=256)
    app = build_app(backend, ServerSettings(), preset_name="baseline")
    server = serve_in_thread(app)
    yield server, (reference, tok)
    server.stop()


def _reference_text(reference: Any, tok: Any, prompt_ids: list[int], n: int) -> str:
    from tests.reference.helpers import transformers_greedy

    tokens, _ = transformers_greedy(reference, prompt_ids, n)
    eos = tok.token_to_id("</s>")
    if eos in tokens:
        tokens = tokens[: tokens.index(eos)]
    return str(tok.decode(tokens, skip_special_tokens=True))


def test_torch_server_completion_matches_transformers_greedy(torch_server) -> None:  # type: ignore[no-untyped-def]
    server, (reference, tok) = torch_server
    client = OpenAI(base_url=server.api_url, api_key="unused")
    prompt = "the cat sat on the mat and then"
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    expected = _reference_text(reference, tok, tok.encode(prompt).ids, 12)
    assert expected.strip() and out.choices[0].text.strip() == expected.strip()
    assert out.usage is not None and out.usage.prompt_tokens == len(tok.encode(prompt).ids)
    streamed = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    assert text.split() == out.choices[0].text.split()
    server.wait_idle()
    server.state.parts.cache.check_invariants()


def test_torch_server_chat_uses_the_checkpoint_template(torch_server) -> None:  # type: ignore[no-untyped-def]
    server, (reference, tok) = torch_server
    client = OpenAI(base_url=server.api_url, api_key="unused")
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "the dog ran to the park"}],
        max_tokens=8,
        temperature=0,
    )
    rendered = "<s><user> the dog ran to the park <assistant>"
    ids = tok.encode(rendered, add_special_tokens=False).ids
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    assert (reply.choices[0].message.content or "").split() == _reference_text(
        reference, tok, ids, 8
    ).split()


def _post(server: LiveServer, path: str, body: dict[str, Any]) -> Any:
    return server.client.post(server.base_url + path, json=body, timeout=60)


def test_torch_server_samples_greedily_below_the_temperature_floor(torch_server) -> None:  # type: ignore[no-untyped-def]
    server, _ = torch_server
    model = server.state.model_name
    body = {"model": model, "prompt": "the cat sat on", "max_tokens": 6, "ignore_eos": True}
    greedy = _post(server, "/v1/completions", {**body, "temperature": 0})
    assert greedy.status_code == 200
    for extra in ({"temperature": 1e-38}, {"temperature": 1.0, "top_p": 1e-300}):
        response = _post(server, "/v1/completions", {**body, **extra})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert server.client.get(server.base_url + "/health").status_code == 200
    server.wait_idle()
    server.state.parts.cache.check_invariants()


def test_torch_chat_with_a_lone_surrogate_is_a_400_naming_the_field(torch_server) -> None:  # type: ignore[no-untyped-def]
    server, _ = torch_server
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "a\\udfff"}]}' % (
        server.state.model_name.encode()
    )
    response = server.client.post(
        server.base_url + "/v1/chat/completions",
        content=raw,
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages.0.content"


def test_torch_unseeded_samples_differ_and_seeded_ones_repeat(torch_server) -> None:  # type: ignore[no-untyped-def]
    server, _ = torch_server
    body = {
        "model": server.state.model_name,
        "prompt": "the dog",
        "max_tokens": 12,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    unseeded = {
        _post(server, "/v1/completions", body).json()["choices"][0]["text"] for _ in range(3)
    }
    assert len(unseeded) > 1
    seeded = [
        _post(server, "/v1/completions", {**body, "seed": 2**62 + 3}).json()["choices"][0]["text"]
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    other = _post(server, "/v1/completions", {**body, "seed": 3}).json()["choices"][0]["text"]
    assert other != seeded[0]  # congruent mod 2^62, yet a different seed


def test_torch_stop_string_spanning_tokens_cuts_the_streamed_text(torch_server) -> None:  # type: ignore[no-untyped-def]
    server, _ = torch_server
    body = {
        "model": server.state.model_name,
        "prompt": "the cat",
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    full = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    words = full.split()
    assert len(words) >= 4
    stop = words[1][-1:] + " " + words[2][:2]  # the end of one word, a space, the next
    cut = _post(server, "/v1/completions", {**body, "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full[: full.index(stop)]
