"""The rest of the vLLM surface agent clients, gateways and dashboards hit, on the sim server:
unknown fields ignored with a warning, `n` choices, tools on a template without tool support,
sessions from `user`, `X-Session-Id` or the conversation, `/tokenize`, `/detokenize`,
`/version`, metrics under vLLM's names, and the structured outputs a model-less executor
refuses."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from hybridserve.server.app import ServerSettings
from hybridserve.server.tokenizer import ByteTokenizer, ChatMessage
from tests.e2e.conftest import MODEL, LiveServer, start_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def vllm_named_server() -> Iterator[LiveServer]:
    server = start_server(settings=ServerSettings(metrics_names="vllm"))
    yield server
    server.stop()


def _post(server: LiveServer, path: str, body: dict[str, Any], **kw: Any) -> Any:
    return server.client.post(server.base_url + path, json=body, timeout=30, **kw)


def test_unknown_fields_are_ignored_with_a_warning(
    live_server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}],
        "max_tokens": 3,
        "store": True,
        "metadata": {"task": "demo"},
    }
    with caplog.at_level(logging.WARNING, logger="hybridserve.server.app"):
        response = _post(live_server, CHAT, body)
    assert response.status_code == 200, response.text
    warned = " ".join(r.getMessage() for r in caplog.records)
    for field in ("store", "metadata", "messages.0.cache_control"):
        assert field in warned


def test_n_choices_per_prompt_in_openai_order(live_server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": ["hello", "bye"], "max_tokens": 8, "n": 3}
    body |= {"ignore_eos": True}
    first = _post(live_server, COMPLETIONS, body).json()
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3, 4, 5]
    assert first["usage"]["completion_tokens"] == 48
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    chat |= {"n": 2, "ignore_eos": True, "stream": True}
    with live_server.client.stream("POST", live_server.base_url + CHAT, json=chat) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: {")]
    assert '"index":0' in lines[0] and '"index":1' in lines[0]  # both roles open the stream


def test_tools_on_a_template_without_tool_support_are_written_in(live_server: LiveServer) -> None:
    messages = [
        {"role": "user", "content": "2+2?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
    ]
    body = {"model": MODEL, "messages": messages, "tools": [TOOL], "max_tokens": 2}
    answer = _post(live_server, "/tokenize", body).json()
    text = bytes(t for t in answer["tokens"] if t < 256).decode()
    assert text.startswith("<|system|>\n# Tools")
    assert '"name": "calculator"' in text
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}' in text
    assert "<|user|>\n<tool_response>\n4\n</tool_response>" in text
    assert _post(live_server, CHAT, body).status_code == 200


def test_tokenize_detokenize_and_version(live_server: LiveServer) -> None:
    answer = _post(live_server, "/tokenize", {"model": MODEL, "prompt": "héllo"}).json()
    assert answer["tokens"] == list("héllo".encode()) and answer["count"] == 6
    assert answer["max_model_len"] == live_server.state.max_model_len
    chat = _post(live_server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.json()["tokens"] == ByteTokenizer().apply_chat_template([ChatMessage("user", "hi")])
    back = _post(live_server, "/detokenize", {"tokens": answer["tokens"]}).json()
    assert back == {"prompt": "héllo"}
    assert live_server.client.get(live_server.base_url + "/version").json()["version"]
    refused = _post(live_server, "/detokenize", {"tokens": [999]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"
    neither = _post(live_server, "/tokenize", {"model": MODEL})
    assert neither.status_code == 400 and neither.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
        ({"min_tokens": 2}, "min_tokens"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
    ],
)
def test_a_model_less_executor_refuses_what_needs_logits(
    live_server: LiveServer, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = _post(live_server, CHAT, {**body, **extra})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and "--executor torch" in error["message"]


def test_sessions_come_from_user_header_or_conversation(live_server: LiveServer) -> None:
    seen: list[str | None] = []
    engine = live_server.state.engine
    submit = engine.submit

    def record(request: Any) -> Any:
        seen.append(request.session_id)
        return submit(request)

    engine.submit = record  # type: ignore[method-assign]
    try:
        first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        later = [*first, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}]
        for messages in (first, later):
            _post(live_server, CHAT, {"model": MODEL, "messages": messages, "max_tokens": 1})
        body = {"model": MODEL, "messages": first, "max_tokens": 1}
        _post(live_server, CHAT, body, headers={"X-Session-Id": "job-7"})
        _post(live_server, CHAT, {**body, "user": "alice"}, headers={"X-Session-Id": "job-7"})
        _post(live_server, COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 1})
        too_long = _post(live_server, CHAT, body, headers={"X-Session-Id": "x" * 2000})
    finally:
        engine.submit = submit  # type: ignore[method-assign]
    assert seen[0] is not None and seen[0].startswith("conv-") and seen[0] == seen[1]
    assert seen[2:] == ["job-7", "alice", None]
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "X-Session-Id"


def test_metrics_are_exported_under_vllm_names(vllm_named_server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
    assert _post(vllm_named_server, COMPLETIONS, body).status_code == 200
    vllm_named_server.wait_idle()
    names = {key.split("{")[0] for key in vllm_named_server.metrics()}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:request_success_total",
        "vllm:generation_tokens_total",
    ):
        assert name in names
    assert not any(name.startswith("hybridserve:") for name in names)
