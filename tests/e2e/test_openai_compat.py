"""What OpenAI and vLLM clients send and expect, on the sim server: the developer role, batched
prompts, the request's own `created`, no empty first chunk, vLLM's neutral sampling values and
nulls, penalties recorded, echo, and the served model names."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from hybridserve.core.request import Request
from hybridserve.server.app import ServerSettings
from hybridserve.server.tokenizer import ByteTokenizer, ChatMessage
from tests.e2e.conftest import MODEL, LiveServer, start_server

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def _post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return server.client.post(server.base_url + path, json=body, timeout=60)


def _events(server: LiveServer, path: str, body: dict[str, Any]) -> list[Any]:
    """The JSON payloads of a stream, [DONE] as the string itself."""
    out: list[Any] = []
    with server.client.stream("POST", server.base_url + path, json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_developer_messages_are_rendered_as_system_instructions(live_server: LiveServer) -> None:
    body = {"model": MODEL, "max_tokens": 3, "ignore_eos": True}
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    response = _post(live_server, CHAT, {**body, "messages": developer})
    assert response.status_code == 200, response.text
    expected = ByteTokenizer().apply_chat_template(
        [ChatMessage("system", "Be brief."), ChatMessage("user", "hi")]
    )
    assert response.json()["usage"]["prompt_tokens"] == len(expected)


def test_a_batch_of_prompts_gets_one_choice_each_in_order(live_server: LiveServer) -> None:
    prompts = ["ab", "cdef", "g"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 5, "ignore_eos": True}
    response = _post(live_server, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert [c["index"] for c in result["choices"]] == [0, 1, 2]
    assert all(len(c["text"]) == 5 and c["finish_reason"] == "length" for c in result["choices"])
    assert result["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 15,
        "total_tokens": 22,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    ids = _post(live_server, COMPLETIONS, {**body, "prompt": [[104, 105], [33]]}).json()
    assert [c["index"] for c in ids["choices"]] == [0, 1]
    assert ids["usage"]["prompt_tokens"] == 3
    live_server.wait_idle()


def test_a_streamed_batch_names_each_chunks_choice(live_server: LiveServer) -> None:
    body = {
        "model": MODEL,
        "prompt": ["x", "yy"],
        "max_tokens": 12,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = _events(live_server, COMPLETIONS, body)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    texts = {0: "", 1: ""}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
    assert len(texts[0]) == 12 and len(texts[1]) == 12
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]
    assert events[-2]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 24,
        "total_tokens": 27,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_a_batch_the_queue_can_never_take_is_refused_whole_with_a_400() -> None:
    server = start_server(settings=ServerSettings(max_waiting=2))
    try:
        body = {"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 2}
        response = _post(server, COMPLETIONS, body)
        assert response.status_code == 400  # no retry can succeed: not a 503
        error = response.json()["error"]
        assert error["code"] == "batch_too_large" and "--max-waiting=2" in error["message"]
        server.wait_idle()
        assert server.metrics()["hybridserve:prompt_tokens_total{}"] == 0
        assert _post(server, COMPLETIONS, {**body, "prompt": ["a", "b"]}).status_code == 200
    finally:
        server.stop()


def test_created_is_the_time_of_the_request(live_server: LiveServer) -> None:
    live_server.state.created = 1  # as if the server had started long ago
    before = int(time.time())
    whole = _post(live_server, COMPLETIONS, {"model": MODEL, "prompt": "a", "max_tokens": 2})
    chat = _post(
        live_server,
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2},
    )
    streamed = _events(
        live_server, COMPLETIONS, {"model": MODEL, "prompt": "a", "max_tokens": 2, "stream": True}
    )
    after = int(time.time())
    for created in (whole.json()["created"], chat.json()["created"], streamed[0]["created"]):
        assert before <= created <= after


def test_a_completion_stream_opens_with_generated_text_not_an_empty_chunk(
    live_server: LiveServer,
) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 6, "ignore_eos": True, "stream": True}
    events = _events(live_server, COMPLETIONS, body)
    assert events[0]["choices"][0]["text"] != ""
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) != ""
    assert all(e["choices"][0]["text"] for e in events[:-1] if not e["choices"][0]["finish_reason"])


def test_a_chat_stream_opens_with_the_role_and_no_content(live_server: LiveServer) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
    }
    events = _events(live_server, CHAT, body)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert events[1]["choices"][0]["delta"]["content"] != ""


# What vLLM's OpenAI server accepts, at the values that change nothing.
VLLM_NEUTRAL: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0,
    "top_k": -1,
    "min_p": 0.0,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "include_stop_str_in_output": False,
    "min_tokens": 0,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "bad_words": [],
    "logit_bias": {},
    "allowed_token_ids": None,
    "truncate_prompt_tokens": None,
    "prompt_logprobs": None,
    "return_tokens_as_token_ids": False,
    "response_format": {"type": "text"},
    "stop_token_ids": [],
    "user": "someone",
}


def test_vllm_bench_serve_bodies_are_served(live_server: LiveServer) -> None:
    # `vllm bench serve`'s completions backend (openai-completions) and chat backend.
    completion = {
        "model": MODEL,
        "prompt": "a prompt",
        "repetition_penalty": 1.0,
        "max_tokens": 8,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    events = _events(live_server, COMPLETIONS, completion)
    assert events[-2]["usage"]["completion_tokens"] == 8
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a prompt"}],
        "max_completion_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    assert _events(live_server, CHAT, chat)[-2]["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_every_vllm_sampling_parameter_is_accepted_at_its_neutral_value(
    live_server: LiveServer, path: str
) -> None:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "ignore_eos": True}
    if path == COMPLETIONS:
        base |= {"prompt": "hi", "echo": False, "add_special_tokens": True, "best_of": 1}
    else:
        base |= {
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": False,
            "tools": [],
            "tool_choice": "none",
            "add_generation_prompt": True,
            "continue_final_message": False,
            "chat_template_kwargs": {},
            "parallel_tool_calls": True,
        }
    response = _post(live_server, path, {**base, **VLLM_NEUTRAL})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logprobs",
        "echo",
        "stream",
        "stream_options",
        "n",
        "user",
        "min_p",
        "logit_bias",
        "suffix",
        "best_of",
        "cache_salt",
    ],
)
def test_null_means_left_out(live_server: LiveServer, field: str) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True, field: None}
    response = _post(live_server, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def _submitted(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> list[Request]:
    seen: list[Request] = []
    submit = server.state.engine.submit

    def spy(request: Request) -> Any:
        seen.append(request)
        return submit(request)

    monkeypatch.setattr(server.state.engine, "submit", spy)
    return seen


def test_the_sim_accepts_and_records_penalties(
    live_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _submitted(live_server, monkeypatch)
    body = {
        "model": MODEL,
        "prompt": "hi",
        "max_tokens": 3,
        "repetition_penalty": 1.3,
        "presence_penalty": -0.5,
        "frequency_penalty": 2,
    }
    assert _post(live_server, COMPLETIONS, body).status_code == 200
    (request,) = seen
    sampling = request.sampling
    assert (sampling.repetition_penalty, sampling.presence_penalty) == (1.3, -0.5)
    assert sampling.frequency_penalty == 2.0 and sampling.has_penalties


def test_echo_puts_the_prompt_before_the_text_on_the_sim(live_server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": "echo me", "max_tokens": 4, "ignore_eos": True, "echo": True}
    choice = _post(live_server, COMPLETIONS, body).json()["choices"][0]
    assert choice["text"].startswith("echo me") and len(choice["text"]) == len("echo me") + 4
    scored = _post(live_server, COMPLETIONS, {**body, "max_tokens": 0}).json()
    assert scored["choices"][0]["text"] == "echo me"
    assert scored["usage"]["completion_tokens"] == 0
    streamed = _events(live_server, COMPLETIONS, {**body, "stream": True})
    assert streamed[0]["choices"][0]["text"].startswith("echo me")
    ids = _post(live_server, COMPLETIONS, {**body, "prompt": [104, 105]}).json()
    assert ids["choices"][0]["text"].startswith("hi")


def test_logprobs_on_the_sim_are_refused_saying_it_has_no_model(live_server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": "x", "logprobs": 1, "echo": True, "max_tokens": 1}
    error = _post(live_server, COMPLETIONS, body).json()["error"]
    assert error["param"] == "logprobs" and "no model" in error["message"]


@pytest.fixture(scope="module")
def named_server() -> Iterator[LiveServer]:
    server = start_server(settings=ServerSettings(served_model_names=("my-model", "alias")))
    yield server
    server.stop()


def test_served_model_names_are_listed_accepted_and_the_first_is_answered(
    named_server: LiveServer,
) -> None:
    client = openai.OpenAI(base_url=named_server.api_url, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["my-model", "alias"]
    for name in ("my-model", "alias"):
        result = client.completions.create(model=name, prompt="hi", max_tokens=2)
        assert result.model == "my-model"
    with pytest.raises(openai.NotFoundError, match="my-model"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_return_token_ids_gives_each_choice_its_generated_and_prompt_ids(
    live_server: LiveServer,
) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True}
    whole = _post(live_server, COMPLETIONS, {**body, "return_token_ids": True})
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["prompt_token_ids"] == [5, 6, 7] and len(choice["token_ids"]) == 6
    events = _events(live_server, COMPLETIONS, {**body, "return_token_ids": True, "stream": True})
    chunks = [e["choices"][0] for e in events if isinstance(e, dict) and e.get("choices")]
    assert chunks[0]["prompt_token_ids"] == [5, 6, 7]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    streamed = [t for c in chunks for t in c["token_ids"]]
    assert len(streamed) == 6 and all(isinstance(t, int) for t in streamed)
    plain = _post(live_server, COMPLETIONS, body).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    scored = {**body, "max_tokens": 0, "echo": True, "return_token_ids": True}
    assert _post(live_server, COMPLETIONS, scored).json()["choices"][0]["token_ids"] == []


def test_return_token_ids_on_chat_is_refused_naming_the_field(live_server: LiveServer) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "return_token_ids": True,
    }
    response = _post(live_server, CHAT, body)
    assert response.status_code == 400
    assert "return_token_ids" in response.text
