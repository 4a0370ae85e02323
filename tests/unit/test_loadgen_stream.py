"""The load generator's reading of a server-sent event stream: events split at CR, LF or CRLF
only, so a token whose text holds a Unicode line boundary (U+2028, U+0085, sent raw inside the
event's JSON, as vLLM sends it) is one event, not two malformed lines."""

from __future__ import annotations

import asyncio
import json

import httpx

from hybridserve.loadgen.client import Completion, stream_completion


def _stream(texts: list[str], newline: str) -> httpx.MockTransport:
    events = [json.dumps({"choices": [{"index": 0, "text": t}]}, ensure_ascii=False) for t in texts]
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": len(texts)}})
    body = "".join(f"data: {e}{newline}{newline}" for e in [*events, usage]) + "data: [DONE]"
    body += newline + newline
    return httpx.MockTransport(lambda request: httpx.Response(200, text=body))


def _complete(transport: httpx.MockTransport) -> Completion:
    async def go() -> Completion:
        async with httpx.AsyncClient(base_url="http://server", transport=transport) as client:
            return await stream_completion(client, {"prompt": [1]}, headers={})

    return asyncio.run(go())


def test_a_token_holding_a_unicode_line_boundary_is_one_event() -> None:
    texts = ["a", "x\u2028y", "\x85", "b\x1cc", "d"]
    for newline in ("\n", "\r\n", "\r"):
        done = _complete(_stream(texts, newline))
        assert done.ok, done.failure
        assert len(done.token_times_s) == len(texts) and done.completion_tokens == len(texts)
