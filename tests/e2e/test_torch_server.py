"""`hybridserve serve --executor torch` on a tiny random Llama checkpoint with a word-level
tokenizer: the OpenAI client gets the same greedy text as transformers, streamed or not."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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
    from hybridserve.server.torch_backend import TorchServingBackend

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


def _log_softmax_rows(reference: Any, tokens: list[int]) -> Any:
    with torch.no_grad():
        ids = torch.tensor([tokens])
        positions = torch.arange(len(tokens))[None]
        logits = reference(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)


def test_torch_completion_logprobs_are_the_models(torch_server) -> None:  # type: ignore[no-untyped-def]
    server, (reference, tok) = torch_server
    prompt = tok.encode("the cat sat on").ids
    body = {
        "model": server.state.model_name,
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 3,
    }
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    from tests.reference.helpers import transformers_greedy

    generated, _ = transformers_greedy(reference, prompt, 6)
    rows = _log_softmax_rows(reference, [*prompt, *generated])
    assert logprobs["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in generated]
    for j, token in enumerate(generated):
        row = rows[len(prompt) + j - 1]
        assert logprobs["token_logprobs"][j] == pytest.approx(float(row[token]), abs=1e-4)
        top = logprobs["top_logprobs"][j]
        want = {
            tok.decode([t], skip_special_tokens=False): float(row[t])
            for t in torch.topk(row, 3).indices.tolist()
        }
        assert top.keys() == want.keys() and list(top.values()) == pytest.approx(
            list(want.values()), abs=1e-4
        )
    assert logprobs["text_offset"][0] == 0
    streamed = server.client.post(
        server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60
    )
    chunks = [
        json.loads(line[6:])
        for line in streamed.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    tokens = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert tokens == logprobs["tokens"]


def test_torch_chat_logprobs_list_the_top_alternatives(torch_server) -> None:  # type: ignore[no-untyped-def]
    server, _ = torch_server
    body = {
        "model": server.state.model_name,
        "messages": [{"role": "user", "content": "the dog ran"}],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 2,
    }
    content = _post(server, "/v1/chat/completions", body).json()["choices"][0]["logprobs"][
        "content"
    ]
    assert len(content) == 4
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(item["top_logprobs"]) == 2
        # Greedy: the chosen token is the most likely one.
        assert item["logprob"] == pytest.approx(item["top_logprobs"][0]["logprob"])
        assert item["bytes"] == list(item["token"].encode())
    plain = _post(server, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": 0})
    assert plain.json()["choices"][0]["logprobs"] is None


def test_torch_penalties_steer_greedy_decoding_as_vllm_defines_them(torch_server) -> None:  # type: ignore[no-untyped-def]
    server, (reference, tok) = torch_server
    prompt = tok.encode("the cat sat on the mat").ids
    body = {
        "model": server.state.model_name,
        "prompt": prompt,
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "repetition_penalty": 3.0,
        "frequency_penalty": 1.5,
        "presence_penalty": 0.5,
    }
    tokens = list(prompt)
    for _ in range(10):
        with torch.no_grad():
            ids, positions = torch.tensor([tokens]), torch.arange(len(tokens))[None]
            row = reference(input_ids=ids, position_ids=positions, use_cache=False).logits[0, -1]
        row = row.float().clone()
        output = tokens[len(prompt) :]
        for t in set(tokens):
            row[t] = row[t] / 3.0 if row[t] > 0 else row[t] * 3.0
        for t in set(output):
            row[t] -= 1.5 * output.count(t) + 0.5
        tokens.append(int(torch.argmax(row)))
    want = tok.decode(tokens[len(prompt) :], skip_special_tokens=True)
    penalized = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    plain = _post(
        server,
        "/v1/completions",
        {k: v for k, v in body.items() if not k.endswith("penalty")},
    ).json()["choices"][0]["text"]
    assert penalized.split() == want.split()
    assert penalized != plain


def test_torch_batched_prompts_answer_as_separate_requests(torch_server) -> None:  # type: ignore[no-untyped-def]
    server, _ = torch_server
    prompts = ["the cat sat on", "a dog ran to the", "then"]
    body = {"model": server.state.model_name, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    alone = [_post(server, "/v1/completions", {**body, "prompt": p}).json() for p in prompts]
    batch = _post(server, "/v1/completions", {**body, "prompt": prompts}).json()
    assert [c["text"] for c in batch["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert batch["usage"]["total_tokens"] == sum(a["usage"]["total_tokens"] for a in alone)


def _stream(server: LiveServer, body: dict[str, Any], first: threading.Event) -> dict[str, Any]:
    """A streamed completion's status, text, usage and error events; `first` is set when its
    first token arrives (the request is running)."""
    out: dict[str, Any] = {"text": "", "errors": [], "usage": None}
    url = server.base_url + "/v1/completions"
    with server.client.stream("POST", url, json=body, timeout=60) as response:
        out["status"] = response.status_code
        if response.status_code != 200:
            out["errors"].append(json.loads(response.read())["error"])
            lines: Iterator[str] = iter(())
        else:
            lines = response.iter_lines()
        for line in lines:
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["errors"].append(event["error"])
                continue
            out["usage"] = event.get("usage") or out["usage"]
            out["text"] += "".join(choice["text"] for choice in event["choices"])
            first.set()
    first.set()
    return out


def test_torch_hostile_repetition_penalty_fails_alone_beside_co_batched_streams(
    torch_server: tuple[LiveServer, Any],
) -> None:
    server, _ = torch_server
    base = {
        "model": server.state.model_name,
        "max_tokens": 120,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    neighbours = [
        {**base, "prompt": "the cat sat on", "temperature": 0},
        {**base, "prompt": "a dog ran to the", "temperature": 0},
        {**base, "prompt": "then the bird", "temperature": 1.0, "seed": 7},
    ]
    hostile = {**base, "prompt": "the mat", "temperature": 1.0, "repetition_penalty": 5e-324}
    alone = [_stream(server, body, threading.Event()) for body in neighbours]
    with ThreadPoolExecutor(len(neighbours) + 1) as pool:
        started = [threading.Event() for _ in neighbours]
        running = [
            pool.submit(_stream, server, b, e) for b, e in zip(neighbours, started, strict=True)
        ]
        for event in started:  # every neighbour is decoding when the hostile one arrives
            assert event.wait(timeout=30)
        refused = pool.submit(_stream, server, hostile, threading.Event()).result()
        together = [future.result() for future in running]
    for got, want in zip(together, alone, strict=True):
        assert got["status"] == 200 and got["errors"] == []
        assert got["usage"]["completion_tokens"] == 120
        assert got["text"] == want["text"]
    assert refused["status"] == 400, refused
    (error,) = refused["errors"]
    assert error["param"] == "repetition_penalty"
    assert "5e-324" in error["message"] and "[0.01, 100]" in error["message"]
    server.wait_idle()
    server.state.parts.cache.check_invariants()


def _backend_for(folder: Path) -> Any:
    from hybridserve.server.torch_backend import TorchServingBackend

    return TorchServingBackend(str(folder), device="cpu", max_model_len=128)


def test_a_checkpoint_with_chat_template_jinja_serves_chat(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "chat_template.jinja").write_text(config.pop("chat_template"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    server = serve_in_thread(build_app(_backend_for(tmp_path), ServerSettings()))
    try:
        body = {
            "model": server.state.model_name,
            "messages": [{"role": "user", "content": "the dog"}],
            "max_tokens": 3,
        }
        response = _post(server, "/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
        rendered = "<s><user> the dog <assistant>"
        ids = tok.encode(rendered, add_special_tokens=False).ids
        assert response.json()["usage"]["prompt_tokens"] == len(ids)
    finally:
        server.stop()


def test_a_model_without_a_chat_template_answers_chat_with_a_400(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    server = serve_in_thread(build_app(_backend_for(tmp_path), ServerSettings()))
    try:
        body = {
            "model": server.state.model_name,
            "messages": [{"role": "user", "content": "the dog"}],
            "max_tokens": 3,
        }
        response = _post(server, "/v1/chat/completions", body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "messages" and "no chat template" in error["message"]
        assert "/v1/completions" in error["message"]
        completion = _post(
            server, "/v1/completions", {"model": body["model"], "prompt": "the", "max_tokens": 2}
        )
        assert completion.status_code == 200
    finally:
        server.stop()


# Whitespace control, `{% if tools %}` on an undefined-by-default variable, a loop filter and
# `raise_exception`: rendered as transformers renders chat templates.
HF_STYLE_TEMPLATE = """{%- if tools %}{{ raise_exception('no tools here') }}{% endif -%}
{% for message in messages %}
    {% if message['role'] == 'system' %}
<sys>{{ message['content'] | trim }}</sys>
    {% else %}
<{{ message['role'] }}>{{ message['content'] }}</{{ message['role'] }}>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}"""


def test_chat_templates_render_as_transformers_renders_them(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    from hybridserve.executor.torch.tokenizer import load_tokenizer

    _, tok = _write_checkpoint(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(HF_STYLE_TEMPLATE)
    ours = load_tokenizer(tmp_path)
    assert ours is not None and ours.chat_template == HF_STYLE_TEMPLATE
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.chat_template = HF_STYLE_TEMPLATE
    messages = [
        {"role": "system", "content": "  be brief  "},
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "sat"},
        {"role": "user", "content": "on"},
    ]
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages) == want


# A template with tool support (as Qwen3's and Hermes' are): tools, an assistant turn's
# tool_calls with parsed arguments, tool turns, and an extra template variable.
TOOL_TEMPLATE = """{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }}:{{
t.function.parameters | tojson }};{% endfor %}</tools>{% endif -%}
{% for m in messages %}<{{ m.role }}>{% if m.content %}{{ m.content }}{% endif %}
{%- for c in m.tool_calls or [] %}<call id={{ c.id }}>{{ c.function.name }}({{
c.function.arguments.expression }})</call>{% endfor %}</{{ m.role }}>{% endfor %}
{%- if add_generation_prompt %}<assistant>{% if enable_thinking is false %}<nothink>{% endif %}
{%- endif %}"""


def test_tools_render_through_the_template_as_transformers_renders_them(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    from hybridserve.server.chat_render import conversation
    from hybridserve.server.tokenizer import ChatMessage
    from hybridserve.server.tool_parsers import ToolCall, ToolFunction
    from hybridserve.server.torch_backend import TorchTokenizer

    _, tok = _write_checkpoint(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    from hybridserve.executor.torch.tokenizer import load_tokenizer

    ours = load_tokenizer(tmp_path)
    assert ours is not None
    server_side = TorchTokenizer(ours, (2,))
    assert server_side.supports_tools
    calc = ToolFunction("calc", None, {"type": "object", "properties": {}})
    messages = [ChatMessage("user", "2+2?"), ChatMessage("assistant", ""),
                ChatMessage("tool", "4", tool_call_id="c1")]  # fmt: skip
    calls = [[], [ToolCall("c1", "calc", '{"expression": "2+2"}')], []]
    rendered, tools = conversation(messages, calls, [calc], native=True)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.chat_template = TOOL_TEMPLATE
    want = hf.apply_chat_template(
        [m.template_dict() for m in rendered],
        tools=tools,
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    got = ours.render_chat(
        [m.template_dict() for m in rendered], tools=tools, options={"enable_thinking": False}
    )
    assert got == want
    assert "<tools>calc:" in got and "<call id=c1>calc(2+2)</call>" in got
    assert got.endswith("<assistant><nothink>")


def test_the_smollm2_gguf_chat_template_renders_as_in_transformers() -> None:
    from hybridserve.executor.torch.checkpoints import builtin_path
    from hybridserve.executor.torch.tokenizer import load_tokenizer

    path = builtin_path("smollm2")
    if not path.is_file():
        pytest.skip(f"{path} is absent (`make models` fetches the built-in SmolLM2 GGUF)")
    pytest.importorskip("gguf", reason="transformers reads GGUF with the gguf package")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = load_tokenizer(path)
    assert ours is not None
    for messages in (
        [{"role": "user", "content": "Say hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"},
        ],
    ):
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.render_chat(messages) == want


def test_a_32_token_block_serves_greedy_text_and_caches_in_32_token_units(
    tmp_path: Path,
) -> None:
    from hybridserve.core.config import SchedulerConfig
    from hybridserve.server.torch_backend import TorchServingBackend

    torch.set_num_threads(1)
    reference, tok = _write_checkpoint(tmp_path)
    backend = TorchServingBackend(str(tmp_path), device="cpu", max_model_len=256, block_size=32)
    assert {spec.block_size for spec in backend.cache_groups()} == {32}
    assert backend.num_blocks(SchedulerConfig()) == 256  # max(256, 4 x 256 / 32)
    server = serve_in_thread(build_app(backend, ServerSettings(), preset_name="baseline"))
    try:
        client = OpenAI(base_url=server.api_url, api_key="unused")
        prompt = " ".join(WORDS[i % len(WORDS)] for i in range(40))  # 41 tokens with <s>
        model = client.models.list().data[0].id
        first = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
        again = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
        expected = _reference_text(reference, tok, tok.encode(prompt).ids, 6)
        assert first.choices[0].text.strip() == again.choices[0].text.strip() == expected.strip()
        details = again.usage.prompt_tokens_details if again.usage else None
        assert details is not None and details.cached_tokens == 32
        server.wait_idle()
        server.state.parts.cache.check_invariants()
    finally:
        server.stop()


def test_num_blocks_sizes_the_executors_pool_and_a_bad_one_is_named(tmp_path: Path) -> None:
    from hybridserve.core.config import SchedulerConfig
    from hybridserve.core.errors import ConfigError
    from hybridserve.server.torch_backend import TorchServingBackend

    torch.set_num_threads(1)
    _write_checkpoint(tmp_path)
    backend = TorchServingBackend(str(tmp_path), device="cpu", max_model_len=256, num_blocks=40)
    assert backend.num_blocks(SchedulerConfig()) == 40
    assert backend._executor.cache.num_blocks == 40  # what is allocated, not only a cap
    with pytest.raises(ConfigError, match="--num-blocks"):
        TorchServingBackend(str(tmp_path), device="cpu", num_blocks=1)


def test_the_backend_loads_its_model_in_a_thread_that_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridserve.executor.torch import runtime
    from hybridserve.server.torch_backend import TorchServingBackend

    loads: list[str] = []
    passing = runtime.in_passing_thread

    def recorded(build: Any) -> Any:
        loads.append(threading.current_thread().name)
        return passing(build)

    monkeypatch.setattr(runtime, "in_passing_thread", recorded)
    _write_checkpoint(tmp_path)
    backend = TorchServingBackend(str(tmp_path), device="cpu", max_model_len=64)
    assert loads == [threading.current_thread().name] and backend.model_name == tmp_path.name


def test_on_a_cpu_serve_takes_vllms_cpu_token_budget_unless_a_flag_or_the_file_gives_one(
    tmp_path: Path,
) -> None:
    from hybridserve.engine.settings import SettingsSources, parse_settings
    from hybridserve.server.backend import serve_settings
    from hybridserve.server.torch_backend import CPU_MAX_NUM_BATCHED_TOKENS, TorchServingBackend

    torch.set_num_threads(1)
    _write_checkpoint(tmp_path)
    backend = TorchServingBackend(str(tmp_path), device="cpu", max_model_len=256)
    assert backend.default_max_num_batched_tokens == CPU_MAX_NUM_BATCHED_TOKENS == 2048
    for preset in ("hybridserve", "baseline"):
        chosen = serve_settings(backend, SettingsSources(preset=preset))
        assert chosen.scheduler.max_num_batched_tokens == 2048
        assert chosen.scheduler.max_model_len == 256
    flagged = SettingsSources(flags=(("max_num_batched_tokens", 8192),))
    assert serve_settings(backend, flagged).scheduler.max_num_batched_tokens == 8192
    filed = SettingsSources(file=parse_settings({"scheduler": {"max_num_batched_tokens": 4096}}))
    assert serve_settings(backend, filed).scheduler.max_num_batched_tokens == 4096
    not_given = SettingsSources(flags=(("max_num_batched_tokens", None),))
    assert serve_settings(backend, not_given).scheduler.max_num_batched_tokens == 2048
