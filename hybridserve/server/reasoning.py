"""Reasoning in a model's output: `--reasoning-parser NAME` splits `<think>...</think>` off as
`reasoning_content`, the rest is `content`.

- `qwen3`: the output must open with `<think>` (after optional whitespace) for anything to be
  reasoning; an output that does not is all content. For templates where the model writes the
  opening tag itself (Qwen3 up to the 2507 releases, QwQ).
- `deepseek_r1`: everything before the first `</think>` is reasoning, with or without an opening
  `<think>` (the chat template often puts it in the prompt); DeepSeek-R1 and its distills, and
  templates such as Qwen3-2507-Thinking's that open the block in the prompt.

In both, an output that ends before `</think>` (cut off by max_tokens) is reasoning throughout
once reasoning began, and the text after `</think>` is content as written (not stripped). The
stream never gives out part of a tag.
"""

from __future__ import annotations

from abc import ABC
from typing import ClassVar

from hybridserve.core.errors import ConfigError

OPEN = "<think>"
CLOSE = "</think>"


def _held_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningStream:
    """Splits one output arriving in fragments: `push` each, then `finish` once; each returns
    (reasoning delta, content delta)."""

    def __init__(self, *, needs_open_tag: bool) -> None:
        self._needs_open_tag = needs_open_tag
        self._state = "start"  # then "reasoning", then "content"
        self._buf = ""

    def push(self, text: str) -> tuple[str, str]:
        """The reasoning and content that `text` (appended to the output) completes."""
        if self._state == "content":
            return "", text
        self._buf += text
        if self._state == "start" and not self._decide_start():
            return "", ""
        if self._state == "content":
            rest, self._buf = self._buf, ""
            return "", rest
        return self._reasoning_part()

    def finish(self) -> tuple[str, str]:
        """What was held back, now that the output has ended."""
        rest, self._buf = self._buf, ""
        if self._state == "content" or (self._state == "start" and self._needs_open_tag):
            return "", rest
        return rest, ""

    def _decide_start(self) -> bool:
        """Settle whether the output opens with <think>; False while it cannot be told."""
        body = self._buf.lstrip()
        if body.startswith(OPEN):
            self._buf = body[len(OPEN) :]
            self._state = "reasoning"
            return True
        if not body or OPEN.startswith(body):
            return False
        self._state = "content" if self._needs_open_tag else "reasoning"
        return True

    def _reasoning_part(self) -> tuple[str, str]:
        end = self._buf.find(CLOSE)
        if end >= 0:
            reasoning, content = self._buf[:end], self._buf[end + len(CLOSE) :]
            self._buf = ""
            self._state = "content"
            return reasoning, content
        keep = _held_length(self._buf, CLOSE)
        reasoning = self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep :]
        return reasoning, ""


class ReasoningParser(ABC):
    """One reasoning format: `--reasoning-parser NAME`."""

    name: ClassVar[str]
    needs_open_tag: ClassVar[bool]

    def stream(self) -> ReasoningStream:
        """A splitter for one output arriving in fragments."""
        return ReasoningStream(needs_open_tag=self.needs_open_tag)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; None where empty."""
        stream = self.stream()
        reasoning, content = stream.push(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    needs_open_tag = True


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    needs_open_tag = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser `--reasoning-parser NAME` names."""
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ConfigError(
            "--reasoning-parser", name, "choose one of " + ", ".join(REASONING_PARSERS)
        )
    return parser()
