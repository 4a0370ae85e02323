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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # system | user | assistant
    content: str


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

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Token ids of the conversation followed by an open assistant turn."""
        ...

    def new_decoder(self) -> IncrementalDecoder:
        """A decoder for one request's output stream."""
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

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> list[int]:
        text = "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"
        return self.encode(text)

    def new_decoder(self) -> ByteDecoder:
        return ByteDecoder()
