"""The official openai client against a live server on the simulated executor."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from hybridserve.server.tokenizer import ByteTokenizer, ChatMessage
from tests.e2e.conftest import MODEL, LiveServer, start_server

VOWELS = ["a", "e", "i", "o", "u"]


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.api_url, api_key="unused", max_retries=0)


def test_completion_returns_max_tokens_of_text_and_usage(client: openai.OpenAI) -> None:
    prompt = "The quick brown fox"
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24)
    choice = result.choices[0]
    assert choice.finish_reason == "length"
    assert len(choice.text) == 24  # sim output is one printable byte per token
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(prompt.encode())
    assert result.usage.completion_tokens == 24
    assert result.usage.total_tokens == len(prompt.encode()) + 24


def test_completion_accepts_token_id_prompt(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt=[104, 105, 33], max_tokens=3)
    assert result.usage is not None and result.usage.prompt_tokens == 3


def test_chat_prompt_tokens_follow_the_sim_chat_template(client: openai.OpenAI) -> None:
    messages = [("system", "Be brief."), ("user", "Name a colour.")]
    result = client.chat.completions.create(
        model=MODEL, messages=[{"role": r, "content": c} for r, c in messages], max_tokens=7
    )
    expected = ByteTokenizer().apply_chat_template([ChatMessage(r, c) for r, c in messages])
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert len(result.choices[0].message.content or "") == 7
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(expected)
    assert result.usage.completion_tokens == 7


def test_streamed_completion_concatenates_and_reports_usage_last(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt="Count:",
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert len(text) == 30
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 30
    assert chunks[-1].usage.prompt_tokens == len(b"Count:")


def test_streamed_chat_opens_with_the_assistant_role(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert len(text) == 12
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_sequence_cuts_the_text_before_the_match(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt="x", max_tokens=300, stop=VOWELS)
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert not any(v in choice.text for v in VOWELS)
    assert result.usage is not None and result.usage.completion_tokens < 300


def test_streamed_stop_sequence_never_leaks_a_partial_match(client: openai.OpenAI) -> None:
    # Two-character stops, 12 of the 784 pairs: 1,000 random letters hold one with
    # probability 1 - (1 - 12/784)^1000 > 0.9999998.
    stops = ["a ", "ab", "zz", "e.", "e ", "o ", "i ", "s ", "t ", "n ", "r ", "th"]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "go"}],
        max_tokens=1000,
        stop=stops,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert not any(s in text for s in stops)


def test_stop_token_ends_output_without_its_text(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=300,
        extra_body={"stop_token_ids": [ord(v) for v in VOWELS]},
    )
    assert result.choices[0].finish_reason == "stop"
    assert not any(v in result.choices[0].text for v in VOWELS)
    assert result.usage is not None
    assert result.usage.completion_tokens == len(result.choices[0].text) + 1


def test_models_lists_the_served_profile(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_requests_with_different_cache_salts_never_share_blocks(
    client: openai.OpenAI, live_server: LiveServer
) -> None:
    prompt = "".join(f"line {i}: the agent reads a file and edits it.\n" for i in range(60))

    def hits_after(salt: str) -> float:
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, extra_body={"cache_salt": salt}
        )
        live_server.wait_idle()
        return live_server.metrics()["hybridserve:prefix_cache_hits_total{}"]

    before = live_server.metrics()["hybridserve:prefix_cache_hits_total{}"]
    first = hits_after("alice")
    other_salt = hits_after("bob")
    same_salt = hits_after("alice")
    assert first == before  # nothing was cached yet
    assert other_salt == first  # bob's lookup cannot see alice's blocks
    assert same_salt > other_salt  # alice's second request reuses her own prefix


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[LiveServer]:
    from hybridserve.server.app import ServerSettings

    server = start_server(settings=ServerSettings(api_key="s3cret"))
    yield server
    server.stop()


@pytest.mark.parametrize(
    "path", ["/v1/models", "/metrics", "/openapi.json", "/docs", "/v1/engines"]
)
@pytest.mark.parametrize("header", [None, "Bearer wrong", "s3cret", "Basic s3cret"])
def test_api_key_is_required_on_every_endpoint_but_health(
    keyed_server: LiveServer, path: str, header: str | None
) -> None:
    headers = {"Authorization": header} if header else {}
    response = keyed_server.client.get(keyed_server.base_url + path, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert keyed_server.client.get(keyed_server.base_url + "/health").status_code == 200


def test_api_key_admits_the_openai_client(keyed_server: LiveServer) -> None:
    good = openai.OpenAI(base_url=keyed_server.api_url, api_key="s3cret", max_retries=0)
    assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
    bad = openai.OpenAI(base_url=keyed_server.api_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
