"""OpenAI response bodies for completions and chat completions, whole and streamed, and their
`logprobs` objects."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from hybridserve.core.plan import TokenLogprob
from hybridserve.server.tool_parsers import ToolCall, ToolCallDelta

if TYPE_CHECKING:
    from hybridserve.server.chat import ChatDelta


class Usage(NamedTuple):
    """A response's token counts; `cached_tokens` are prompt tokens the prefix cache served
    (vLLM's and OpenAI's `usage.prompt_tokens_details.cached_tokens`)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class _Format:
    object_full = ""
    object_chunk = ""

    def __init__(self, model: str, response_id: str, created: int) -> None:
        self.model = model
        self.response_id = response_id
        self.created = created

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(self, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        body = self._envelope(self.object_full, choices)
        body["usage"] = usage.body()
        return body

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return self._envelope(self.object_chunk, choices)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, [])
        body["usage"] = usage.body()
        return body

    def first_chunk(self, num_choices: int = 1) -> dict[str, Any] | None:
        """What a stream opens with before any token, if anything."""
        return None


class CompletionFormat(_Format):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    stream_choice = choice


class ChatFormat(_Format):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def stream_choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        delta = {"content": text} if text or finish_reason is None else {}
        return {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def message_choice(
        self,
        index: int,
        output: tuple[str | None, str | None, Sequence[ToolCall]],
        finish_reason: str | None,
        logprobs: dict[str, Any] | None,
        *,
        with_reasoning: bool,
    ) -> dict[str, Any]:
        """A whole choice read back: (content, reasoning, tool calls); `content` is null when
        the turn is only calls, as OpenAI sends it."""
        content, reasoning, calls = output
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if with_reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def delta_choice(
        self,
        index: int,
        delta: ChatDelta,
        finish_reason: str | None,
        logprobs: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """A streamed piece read back: content, reasoning and tool-call deltas, in OpenAI's
        shape (a call's first delta carries its id, type and name)."""
        body: dict[str, Any] = {}
        if delta.content:
            body["content"] = delta.content
        if delta.reasoning:
            body["reasoning_content"] = delta.reasoning
        if delta.tool_calls:
            body["tool_calls"] = [_call_delta(d) for d in delta.tool_calls]
        return {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish_reason}

    def first_chunk(self, num_choices: int = 1) -> dict[str, Any]:
        """The role of each choice, as OpenAI opens a chat stream; it carries no content."""
        choices = [
            {"index": i, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}
            for i in range(num_choices)
        ]
        return self.chunk(choices)


def _call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": delta.arguments}
    out: dict[str, Any] = {"index": delta.index}
    if delta.id is not None:
        out["id"] = delta.id
        out["type"] = "function"
    if delta.name is not None:
        function["name"] = delta.name
    out["function"] = function
    return out


class CompletionLogprobs:
    """One choice's legacy completions `logprobs` object (`tokens`, `token_logprobs`,
    `top_logprobs`, `text_offset`), built piece by piece. `top_logprobs` maps token text to
    log-probability for the N most likely tokens and the chosen one (as vLLM lists them); an
    echoed prompt's first token has `null` for both. Offsets add up the tokens' texts, the
    prompt's from 0 and the output's from `output_offset` (the echoed prompt's length)."""

    def __init__(self, token_text: Callable[[int], str], *, output_offset: int = 0) -> None:
        self._text = token_text
        self._prompt_offset = 0
        self._output_offset = output_offset

    def block(
        self,
        prompt: Sequence[tuple[int, TokenLogprob | None]] = (),
        generated: Sequence[TokenLogprob] = (),
    ) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        entries = [*((t, e, True) for t, e in prompt), *((e.token_id, e, False) for e in generated)]
        for token_id, entry, in_prompt in entries:
            text = self._text(token_id)
            tokens.append(text)
            if in_prompt:
                offsets.append(self._prompt_offset)
                self._prompt_offset += len(text)
            else:
                offsets.append(self._output_offset)
                self._output_offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(entry.logprob)
            top = {self._text(t): lp for t, lp in entry.top}
            top.setdefault(text, entry.logprob)
            top_logprobs.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }


class ChatLogprobs:
    """A chat choice's `logprobs` object: `{"content": [{token, logprob, bytes,
    top_logprobs}]}`, `top_logprobs` holding the `top_logprobs` most likely tokens."""

    def __init__(self, token_text: Callable[[int], str]) -> None:
        self._text = token_text

    def _item(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def block(self, generated: Sequence[TokenLogprob]) -> dict[str, Any]:
        content = []
        for entry in generated:
            item = self._item(entry.token_id, entry.logprob)
            item["top_logprobs"] = [self._item(t, lp) for t, lp in entry.top]
            content.append(item)
        return {"content": content}
