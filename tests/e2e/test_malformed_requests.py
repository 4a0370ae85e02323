"""Bad input gets an OpenAI-style error naming the field, and leaves nothing behind."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from tests.e2e.conftest import MODEL, LiveServer, start_server

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BASE: dict[str, Any] = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
CHAT_BASE: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 4,
}


NESTED_980 = b"[" * 980 + b"]" * 980
NESTED_500 = b"[" * 500 + b"]" * 500


def without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


# (id, path, body: dict or raw bytes, status, param)
CASES: list[tuple[str, str, dict[str, Any] | bytes, int, str]] = [
    ("missing-model", COMPLETIONS, without(BASE, "model"), 400, "model"),
    ("missing-prompt", COMPLETIONS, without(BASE, "prompt"), 400, "prompt"),
    ("prompt-int", COMPLETIONS, {**BASE, "prompt": 123}, 400, "prompt"),
    ("prompt-empty", COMPLETIONS, {**BASE, "prompt": ""}, 400, "prompt"),
    ("prompt-empty-ids", COMPLETIONS, {**BASE, "prompt": []}, 400, "prompt"),
    ("prompt-negative-id", COMPLETIONS, {**BASE, "prompt": [5, -1]}, 400, "prompt"),
    ("prompt-id-past-vocab", COMPLETIONS, {**BASE, "prompt": [5, 9999]}, 400, "prompt"),
    (
        "prompt-lone-surrogate",
        COMPLETIONS,
        b'{"model": "%s", "prompt": "\\ud800"}' % MODEL.encode(),
        400,
        "prompt",
    ),
    ("prompt-too-long", COMPLETIONS, {**BASE, "prompt": "x" * 5000}, 400, "prompt"),
    ("max-tokens-zero", COMPLETIONS, {**BASE, "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-negative", COMPLETIONS, {**BASE, "max_tokens": -5}, 400, "max_tokens"),
    ("max-tokens-string", COMPLETIONS, {**BASE, "max_tokens": "10"}, 400, "max_tokens"),
    ("max-tokens-float", COMPLETIONS, {**BASE, "max_tokens": 1.5}, 400, "max_tokens"),
    ("max-tokens-past-context", COMPLETIONS, {**BASE, "max_tokens": 4092}, 400, "max_tokens"),
    ("temperature-string", COMPLETIONS, {**BASE, "temperature": "hot"}, 400, "temperature"),
    ("temperature-too-high", COMPLETIONS, {**BASE, "temperature": 5}, 400, "temperature"),
    ("top-p-zero", COMPLETIONS, {**BASE, "top_p": 0}, 400, "top_p"),
    ("top-k-below-minus-one", COMPLETIONS, {**BASE, "top_k": -2}, 400, "top_k"),
    ("n-past-16", COMPLETIONS, {**BASE, "n": 17}, 400, "n"),
    ("unknown-model", COMPLETIONS, {**BASE, "model": "gpt-9"}, 404, "model"),
    ("unsupported-logit-bias", COMPLETIONS, {**BASE, "logit_bias": {"1": 2}}, 400, "logit_bias"),
    ("sim-has-no-logprobs", COMPLETIONS, {**BASE, "logprobs": 1}, 400, "logprobs"),
    ("logprobs-past-20", COMPLETIONS, {**BASE, "logprobs": 21}, 400, "logprobs"),
    (
        "echo-with-zero-tokens-on-sim",
        COMPLETIONS,
        {**BASE, "logprobs": 0, "echo": True},
        400,
        "logprobs",
    ),
    ("penalty-past-2", COMPLETIONS, {**BASE, "presence_penalty": 2.5}, 400, "presence_penalty"),
    (
        "frequency-penalty-string",
        COMPLETIONS,
        {**BASE, "frequency_penalty": "0"},
        400,
        "frequency_penalty",
    ),
    (
        "repetition-penalty-zero",
        COMPLETIONS,
        {**BASE, "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    (
        "repetition-penalty-that-overflows-float32",
        COMPLETIONS,
        {**BASE, "repetition_penalty": 5e-324},
        400,
        "repetition_penalty",
    ),
    (
        "repetition-penalty-past-100",
        COMPLETIONS,
        {**BASE, "repetition_penalty": 1e39},
        400,
        "repetition_penalty",
    ),
    ("min-p-nonzero", COMPLETIONS, {**BASE, "min_p": 0.1}, 400, "min_p"),
    (
        "skip-special-tokens-false",
        COMPLETIONS,
        {**BASE, "skip_special_tokens": False},
        400,
        "skip_special_tokens",
    ),
    ("min-tokens", COMPLETIONS, {**BASE, "min_tokens": 3}, 400, "min_tokens"),
    ("guided-json", COMPLETIONS, {**BASE, "guided_json": {"type": "object"}}, 400, "guided_json"),
    (
        "response-format-json",
        COMPLETIONS,
        {**BASE, "response_format": {"type": "json_object"}},
        400,
        "response_format",
    ),
    ("suffix", COMPLETIONS, {**BASE, "suffix": "end"}, 400, "suffix"),
    (
        "max-tokens-zero-without-echo",
        COMPLETIONS,
        {**BASE, "max_tokens": 0, "echo": False},
        400,
        "max_tokens",
    ),
    ("prompt-batch-with-an-empty-one", COMPLETIONS, {**BASE, "prompt": ["a", ""]}, 400, "prompt"),
    ("prompt-batch-mixed", COMPLETIONS, {**BASE, "prompt": ["a", [1, 2]]}, 400, "prompt"),
    ("prompt-batch-id-past-vocab", COMPLETIONS, {**BASE, "prompt": [[1], [9999]]}, 400, "prompt"),
    ("prompt-bool-ids", COMPLETIONS, {**BASE, "prompt": [True, False]}, 400, "prompt"),
    ("stream-string", COMPLETIONS, {**BASE, "stream": "yes"}, 400, "stream"),
    ("stop-empty-string", COMPLETIONS, {**BASE, "stop": [""]}, 400, "stop"),
    ("stop-too-many", COMPLETIONS, {**BASE, "stop": [str(i) for i in range(17)]}, 400, "stop"),
    ("stop-int", COMPLETIONS, {**BASE, "stop": 5}, 400, "stop"),
    ("stop-token-negative", COMPLETIONS, {**BASE, "stop_token_ids": [-3]}, 400, "stop_token_ids.0"),
    ("cache-salt-empty", COMPLETIONS, {**BASE, "cache_salt": ""}, 400, "cache_salt"),
    ("priority-on-fcfs", COMPLETIONS, {**BASE, "priority": 3}, 400, "priority"),
    (
        "stream-options-type",
        COMPLETIONS,
        {**BASE, "stream": True, "stream_options": {"include_usage": "yes"}},
        400,
        "stream_options.include_usage",
    ),
    ("echo-zero", COMPLETIONS, {**BASE, "echo": 0}, 400, "echo"),
    ("max-tokens-bool", COMPLETIONS, {**BASE, "max_tokens": True}, 400, "max_tokens"),
    ("seed-past-64-bits", COMPLETIONS, {**BASE, "seed": 2**63}, 400, "seed"),
    (
        "stream-options-without-stream",
        COMPLETIONS,
        {**BASE, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    (
        "stream-options-with-stream-false",
        COMPLETIONS,
        {**BASE, "stream": False, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("body-not-json", COMPLETIONS, b'{"model": ', 400, "body"),
    (
        "body-nested-980-deep",
        COMPLETIONS,
        b'{"model": "m", "user": ' + NESTED_980 + b"}",
        400,
        "body",
    ),
    ("body-nested-5000-deep", COMPLETIONS, b"[" * 5000 + b"]" * 5000, 400, "body"),
    (
        "prompt-nested-500-deep",
        COMPLETIONS,
        b'{"model": "m", "prompt": ' + NESTED_500 + b"}",
        400,
        "prompt",
    ),
    (
        "body-int-4301-digits",
        COMPLETIONS,
        b'{"model": "m", "prompt": "hi", "max_tokens": 1' + b"0" * 4300 + b"}",
        400,
        "body",
    ),
    ("body-json-array", COMPLETIONS, b"[1, 2]", 400, "body"),
    ("body-invalid-utf8", COMPLETIONS, b'{"model": "\xff\xfe", "prompt": "hi"}', 400, "body"),
    (
        "body-too-large",
        COMPLETIONS,
        json.dumps({**BASE, "prompt": "y" * 70_000}).encode(),
        413,
        "body",
    ),
    ("chat-missing-messages", CHAT, without(CHAT_BASE, "messages"), 400, "messages"),
    ("chat-no-messages", CHAT, {**CHAT_BASE, "messages": []}, 400, "messages"),
    (
        "chat-unknown-role",
        CHAT,
        {**CHAT_BASE, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages.0.role",
    ),
    (
        "chat-content-int",
        CHAT,
        {**CHAT_BASE, "messages": [{"role": "user", "content": 5}]},
        400,
        "messages.0.content",
    ),
    (
        "chat-missing-content",
        CHAT,
        {**CHAT_BASE, "messages": [{"role": "user"}]},
        400,
        "messages.0.content",
    ),
    (
        "chat-max-completion-zero",
        CHAT,
        {**CHAT_BASE, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    ("chat-max-tokens-past-context", CHAT, {**CHAT_BASE, "max_tokens": 5000}, 400, "max_tokens"),
    (
        "chat-tool-without-function",
        CHAT,
        {**CHAT_BASE, "tools": [{"type": "function"}]},
        400,
        "tools.0.function",
    ),
    ("chat-logprobs-zero", CHAT, {**CHAT_BASE, "logprobs": 0}, 400, "logprobs"),
    ("chat-sim-has-no-logprobs", CHAT, {**CHAT_BASE, "logprobs": True}, 400, "logprobs"),
    (
        "chat-top-logprobs-without-logprobs",
        CHAT,
        {**CHAT_BASE, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "chat-tool-choice-required",
        CHAT,
        {**CHAT_BASE, "tool_choice": "required"},
        400,
        "tool_choice",
    ),
    (
        "chat-template-override",
        CHAT,
        {**CHAT_BASE, "chat_template": "{{ x }}"},
        400,
        "chat_template",
    ),
    ("chat-echo", CHAT, {**CHAT_BASE, "echo": True}, 400, "echo"),
    (
        "chat-max-completion-past-context",
        CHAT,
        {**CHAT_BASE, "max_completion_tokens": 5000},
        400,
        "max_completion_tokens",
    ),
    (
        "chat-lone-surrogate",
        CHAT,
        b'{"model": "%s", "messages": [{"role": "user", "content": "a\\udfff"}]}' % MODEL.encode(),
        400,
        "messages.0.content",
    ),
    ("chat-unknown-model", CHAT, {**CHAT_BASE, "model": "other"}, 404, "model"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_malformed_request_is_rejected_naming_the_field(
    live_server: LiveServer, path: str, body: dict[str, Any] | bytes, status: int, param: str
) -> None:
    url = live_server.base_url + path
    if isinstance(body, bytes):
        response = live_server.client.post(
            url, content=body, headers={"Content-Type": "application/json"}
        )
    else:
        response = live_server.client.post(url, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]


def test_rejected_requests_leave_nothing_queued_or_allocated(live_server: LiveServer) -> None:
    before = live_server.metrics()
    for _, path, body, _, _ in CASES:
        if isinstance(body, dict):
            live_server.client.post(live_server.base_url + path, json=body)
    live_server.wait_idle()
    after = live_server.metrics()
    assert after["hybridserve:num_requests_running{}"] == 0
    assert after["hybridserve:num_requests_waiting{}"] == 0
    assert after["hybridserve:kv_cache_usage_perc{}"] == 0
    assert after["hybridserve:prompt_tokens_total{}"] == before["hybridserve:prompt_tokens_total{}"]
    cache = live_server.state.parts.cache
    with live_server.state.engine.lock:
        cache.check_invariants()
        assert cache.num_free_blocks == cache.layout.num_blocks - 1


def test_unknown_route_answers_an_openai_style_404(live_server: LiveServer) -> None:
    response = live_server.client.get(live_server.base_url + "/v1/engines")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "404"


def test_integral_floats_are_accepted_as_token_counts(live_server: LiveServer) -> None:
    completion = live_server.client.post(
        live_server.base_url + COMPLETIONS, json={**BASE, "max_tokens": 1.0, "ignore_eos": True}
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 1
    chat = live_server.client.post(
        live_server.base_url + CHAT,
        json={**without(CHAT_BASE, "max_tokens"), "max_completion_tokens": 2.0, "ignore_eos": True},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 2


def test_a_route_exception_answers_a_generic_500_and_logs_the_detail(
    live_server: LiveServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(text: str) -> list[int]:
        raise RuntimeError("secret detail /opt/models/private")

    monkeypatch.setattr(live_server.state.tokenizer, "encode", broken)
    with caplog.at_level(logging.ERROR, logger="hybridserve.server.app"):
        response = live_server.client.post(live_server.base_url + COMPLETIONS, json=BASE)
    assert response.status_code == 500
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "internal_error" and "secret" not in response.text
    error_id = error["message"].split("error id ")[1].rstrip(")")
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and "secret detail" in str(logged[0].exc_info[1] if logged[0].exc_info else "")


def test_a_prompt_that_cannot_fit_the_whole_kv_pool_gets_a_400_and_the_queue_goes_on() -> None:
    server = start_server(num_blocks=8)  # the sim model: 544-token blocks, 4 groups
    try:
        url = server.base_url + "/v1/completions"
        long = server.client.post(url, json={"model": MODEL, "prompt": [7] * 4000, "max_tokens": 2})
        assert long.status_code == 400, long.text
        error = long.json()["error"]
        assert error["code"] == "too_long_for_the_kv_pool" and error["param"] == "prompt"
        assert "<4000 tokens> cannot start" in error["message"]
        short = server.client.post(url, json={"model": MODEL, "prompt": [7] * 5, "max_tokens": 2})
        assert short.status_code == 200, short.text
        server.wait_idle()
        cache = server.state.parts.cache
        with server.state.engine.lock:
            assert cache.num_free_blocks == cache.usable_blocks
    finally:
        server.stop()
