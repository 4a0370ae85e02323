"""One streamed `/v1/completions` request to an OpenAI-compatible server, timed on the client.

`stream_completion` sends a token-id prompt with `max_tokens` and `ignore_eos`, reads the
server-sent events and returns a `Completion`: when each chunk with a choice arrived, the usage's
output and cached prompt tokens (`usage.prompt_tokens_details.cached_tokens`, None where the
server does not report it) and, for a request that did not complete, why: the HTTP status
(`"500"`), an error event inside the stream (`"stream:CODE"`), a connection dropped before
`[DONE]` (`"disconnect"`), a timeout (`"timeout"`) or a refused connection (`"connect"`).
Nothing here raises for a failing server: failures are data, counted by the caller.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from hybridserve.core.errors import ConfigError

COMPLETIONS_PATH = "/v1/completions"
_SSE_BREAK = re.compile(r"\r\n|\r|\n")


@dataclass(slots=True)
class Completion:
    """What the client saw of one request (monotonic seconds)."""

    sent_s: float
    token_times_s: list[float] = field(default_factory=list)  # chunks with a choice
    completion_tokens: int | None = None  # usage.completion_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    failure: str | None = None  # None: completed; else the status it failed with
    done_s: float | None = None
    # The generated token ids the chunks carried (vLLM's return_token_ids), and whether any
    # chunk carried the field at all (a server that ignores the request sends none).
    token_ids: list[int] = field(default_factory=list)
    token_ids_reported: bool = False

    @property
    def ok(self) -> bool:
        return self.failure is None


def request_headers(api_key: str | None, session_id: str | None) -> dict[str, str]:
    headers = {"Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if session_id is not None:
        headers["X-Session-Id"] = session_id
    return headers


def completion_body(
    *,
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    session_id: str | None,
    token_ids: bool = False,
) -> dict[str, Any]:
    """The request: a token-id prompt, exactly `max_tokens` output tokens (ignore_eos), greedy,
    streamed with the usage, the session id as OpenAI's end-user id; with `token_ids`, asking
    for the generated ids beside the text (vLLM's `return_token_ids`)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if session_id is not None:
        body["user"] = session_id
    if token_ids:
        body["return_token_ids"] = True
    return body


async def stream_completion(
    client: httpx.AsyncClient,
    body: Mapping[str, Any],
    *,
    headers: Mapping[str, str],
    into: Completion | None = None,
) -> Completion:
    """Send `body` to `client`'s base URL and time its stream, filling `into` as the stream
    comes (for a caller that watches it live; default: a new Completion); never raises for
    the server's failures (see the module docstring)."""
    result = into if into is not None else Completion(sent_s=0.0)
    result.sent_s = time.monotonic()
    try:
        async with client.stream("POST", COMPLETIONS_PATH, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                result.failure = str(resp.status_code)
                return result
            finished = False
            async for line in sse_lines(resp):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    finished = True
                    break
                _read_event(result, data)
                if result.failure is not None:
                    return result
            if not finished:
                result.failure = "disconnect"
    except httpx.TimeoutException:
        result.failure = "timeout"
    except httpx.ConnectError:
        result.failure = "connect"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
        result.failure = "disconnect"
    except httpx.HTTPError as exc:
        result.failure = type(exc).__name__
    result.done_s = time.monotonic()
    return result


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The lines of a server-sent event stream: split at CR, LF or CRLF only, as the SSE
    format says. (httpx's `aiter_lines` also splits at U+2028, U+0085 and the other Unicode
    line boundaries, which a server may send raw inside an event's JSON: vLLM does, for a
    token whose text holds one, and the event then read as two malformed lines.)"""
    rest = ""
    async for text in response.aiter_text():
        *lines, rest = _SSE_BREAK.split(rest + text)
        for line in lines:
            yield line
    if rest:
        yield rest


def _read_event(result: Completion, data: str) -> None:
    now = time.monotonic()
    try:
        event = json.loads(data)
    except json.JSONDecodeError:
        result.failure = "stream:malformed"
        return
    if not isinstance(event, dict):
        result.failure = "stream:malformed"
        return
    error = event.get("error")
    if error is not None:
        code = error.get("code") if isinstance(error, dict) else None
        result.failure = f"stream:{code or 'error'}"
        return
    # Every chunk with a choice is a delivery, even with no text (a token that decodes to
    # nothing, an <eos> under ignore_eos); the usage chunk has no choice.
    choices = event.get("choices")
    if choices:
        result.token_times_s.append(now)
        first = choices[0] if isinstance(choices, list) else None
        ids = first.get("token_ids") if isinstance(first, dict) else None
        if isinstance(ids, list):
            result.token_ids_reported = True
            result.token_ids.extend(t for t in ids if isinstance(t, int))
    usage = event.get("usage")
    if isinstance(usage, dict):
        tokens = usage.get("completion_tokens")
        if isinstance(tokens, int):
            result.completion_tokens = tokens
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            result.cached_tokens = details["cached_tokens"]


class UnreachableServer(ConfigError):
    """The --url does not answer."""


async def served_model(client: httpx.AsyncClient, *, url: str, api_key: str | None) -> str | None:
    """The first model `GET /v1/models` lists (None: it lists none), which also checks that
    `url` answers. Raises UnreachableServer naming --url, ConfigError naming --api-key."""
    try:
        resp = await client.get("/v1/models", headers=request_headers(api_key, None))
    except httpx.HTTPError as exc:
        raise UnreachableServer(
            "--url",
            url,
            f"the server does not answer ({type(exc).__name__}: {exc or 'no reply'}); start "
            "it, or give the address it listens on, e.g. http://127.0.0.1:8000",
        ) from None
    if resp.status_code in (401, 403):
        raise ConfigError(
            "--api-key", "***" if api_key else None, f"{url} refused it; give its API key"
        )
    try:
        name = resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return name if isinstance(name, str) else None
