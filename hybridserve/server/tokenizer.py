"""The tokenizer interface the server needs, and the byte-level tokenizer of sim mode.

A serving backend brings a `Tokenizer`: `encode`, a fresh `IncrementalDecoder` per request
(text comes out as tokens arrive, never splitting a multi-byte character), a chat template and
its end-of-sequence ids.

`ByteTokenizer` needs no vocabulary file: token id = UTF-8 byte value (0-255), and id 256 is
`<eos>`. Its chat template is plain text, one block per message and an open assistant block:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# The variables a chat template gets from the request itself; `chat_template_kwargs` cannot
# replace them.
TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"}
)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # system | user | assistant | tool
    content: str
    # An assistant turn's tool calls as chat templates read them:
    # {"id", "type": "function", "function": {"name", "arguments": {...}}}.
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None  # the call a tool message answers
    name: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as transformers and vLLM hand it to a chat template."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [dict(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class IncrementalDecoder(Protocol):
    def push(self, token_ids: Sequence[int]) -> str:
        """Text completed by these tokens; bytes of an unfinished character are held back."""
        ...

    def flush(self) -> str:
        """Whatever is held back, at the end of the output."""
        ...


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may contain are 0 .. vocab_size - 1."""
        ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation unless the request sets `ignore_eos`."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (a completion prompt), special tokens included as the model
        expects them at the start of a prompt. Raises UnicodeEncodeError on lone surrogates."""
        ...

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders `tools` (and tool turns) itself; when it does
        not, the server writes them into the conversation in the hermes convention."""
        ...

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the conversation followed by an open assistant turn; `tools` are
        OpenAI tool definitions for the template, `options` extra template variables
        (`chat_template_kwargs`)."""
        ...

    def new_decoder(self) -> IncrementalDecoder:
        """A decoder for one request's output stream."""
        ...

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens spelled out), for log-probability listings."""
        ...


BYTE_VOCAB_SIZE = 257
BYTE_EOS_ID = 256


class ByteDecoder:
    """UTF-8 bytes in, text out; invalid bytes become U+FFFD; ids outside 0-255 are skipped."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Sequence[int]) -> str:
        data = bytes(t for t in token_ids if 0 <= t < 256)
        return self._decoder.decode(data) if data else ""

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class OffsetDecoder:
    """Incremental detokenisation over a sliding window of token ids, for any `decode(ids)`.

    The offset-window approach of vLLM's `detokenize_incrementally` and of `tokenizers`'
    `DecodeStream`: each push decodes the ids since the last text it released plus the ids
    of that release as context (so that decoders which join or strip at token boundaries see
    the same neighbours as a whole decode), and releases what the new ids add. A push costs
    the size of that window, not of the output so far: a stream of n tokens costs O(n). Text
    ending in U+FFFD (an incomplete UTF-8 sequence) is held back until it completes; the
    concatenated releases equal `decode(all ids)` for prefix-stable decoders (byte-level BPE,
    sentencepiece with byte fallback, word-level joins).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # window start: the ids of the last release, kept as context
        self._read = 0  # ids up to here are released

    def push(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        return self._release(final=False)

    def flush(self) -> str:
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        ids, start, read = self._ids, self._prefix, self._read
        if read == len(ids):
            return ""
        context = self._decode(ids[start:read]) if read > start else ""
        text = self._decode(ids[start:])
        if not final and (len(text) <= len(context) or text.endswith("\ufffd")):
            return ""  # nothing new yet, or a character still incomplete
        self._prefix, self._read = read, len(ids)
        return text[len(context) :]


class ByteTokenizer:
    """The built-in tokenizer of `--executor sim`: one token per UTF-8 byte."""

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (BYTE_EOS_ID,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    @property
    def supports_tools(self) -> bool:
        return False

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> list[int]:
        text = "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"
        return self.encode(text)

    def new_decoder(self) -> ByteDecoder:
        return ByteDecoder()

    def token_text(self, token_id: int) -> str:
        if token_id == BYTE_EOS_ID:
            return "<eos>"
        return bytes([token_id]).decode("utf-8", errors="replace")
