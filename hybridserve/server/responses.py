"""OpenAI response bodies for completions and chat completions, whole and streamed."""

from __future__ import annotations

from typing import Any, Protocol


def usage(num_prompt: int, num_output: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_output,
        "total_tokens": num_prompt + num_output,
    }


class ResponseFormat(Protocol):
    def full(
        self, text: str, finish_reason: str | None, num_prompt: int, num_output: int
    ) -> dict[str, Any]: ...

    def first_chunk(self) -> dict[str, Any]: ...

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]: ...

    def usage_chunk(self, num_prompt: int, num_output: int) -> dict[str, Any]: ...


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

    def usage_chunk(self, num_prompt: int, num_output: int) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, [])
        body["usage"] = usage(num_prompt, num_output)
        return body


class CompletionFormat(_Format):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def full(
        self, text: str, finish_reason: str | None, num_prompt: int, num_output: int
    ) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body = self._envelope(self.object_full, [choice])
        body["usage"] = usage(num_prompt, num_output)
        return body

    def first_chunk(self) -> dict[str, Any]:
        return self.chunk("", None)

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope(self.object_chunk, [choice])


class ChatFormat(_Format):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def full(
        self, text: str, finish_reason: str | None, num_prompt: int, num_output: int
    ) -> dict[str, Any]:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        body = self._envelope(self.object_full, [choice])
        body["usage"] = usage(num_prompt, num_output)
        return body

    def first_chunk(self) -> dict[str, Any]:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._envelope(self.object_chunk, [choice])

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text or finish_reason is None else {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope(self.object_chunk, [choice])
