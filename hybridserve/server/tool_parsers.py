"""Tool calls in a model's output: `--tool-call-parser NAME` picks the format a model was trained
to write its calls in, and the parser turns an output (whole, or arriving in fragments) into the
OpenAI shape: the content outside the calls, and each call's id, name and arguments.

Formats:

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several in a row
  (Qwen2.5, Qwen3, Qwen3-Next, Hermes, SmolLM3).
- `llama3_json`: the whole output is `{"name": ..., "parameters": {...}}` ("arguments" is also
  read), or several such objects separated by `; `, optionally after `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the later
  `[TOOL_CALLS]NAME[ARGS]{...}` per call.

A block that looks like a call but is not a JSON object with a non-empty string `name` and an
object of arguments stays content, as written. A call is streamed once its block is complete (its
closing tag or brace arrived, or the output ended): its first delta carries the id and the name,
the second the whole arguments text, so a call whose JSON turns out broken was never half sent.
Content deltas never hold part of a tag; they are the content with its leading and trailing
whitespace removed, as `extract` gives it.

`grammar()` writes a Lark grammar in llguidance's dialect that forces one call (or one or more)
in the parser's format, each naming one of the request's functions with arguments that validate
against that function's JSON schema (for tool_choice "required" or a named function).
"""

from __future__ import annotations

import json
import math
import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hybridserve.core.errors import ConfigError, RequestError


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: `arguments` is a JSON object as text, `json.dumps(obj, ensure_ascii=False)`."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A streamed piece of call `index`: its first delta carries `id` and `name`, later ones
    argument fragments only; the fragments of one index concatenate to its `arguments`."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedDelta:
    """What one pushed fragment (or the end of the output) released: content and call pieces."""

    content: str
    tool_calls: tuple[ToolCallDelta, ...]


def _no_parameters() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolFunction:
    """A function a request offers: `parameters` is its arguments' JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=_no_parameters)


def new_call_id() -> str:
    """A fresh call id: "call_" and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


# ---- JSON helpers shared by the formats ----


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a double")
    return value


def _load_json(text: str) -> object:
    """The JSON value `text` holds, or None when it holds none (NaN, Infinity and numbers that
    overflow a double included: they could not be written back as JSON)."""
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError):
        return None


def _arguments_text(arguments: dict[str, Any]) -> str:
    text = json.dumps(arguments, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (a \ud800 escape): keep it escaped
        text = json.dumps(arguments)
    return text


def _call_from_object(
    obj: object, keys: tuple[str, ...], *, required: bool
) -> tuple[str, str] | None:
    """(name, arguments text) when `obj` is a call: a non-empty string `name` and an object
    (or a string holding one) under exactly one of `keys`; None otherwise."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    present = [key for key in keys if key in obj]
    if len(present) > 1 or (required and not present):
        return None
    arguments = obj[present[0]] if present else {}
    if isinstance(arguments, str):
        arguments = _load_json(arguments)
    if not isinstance(arguments, dict):
        return None
    return name, _arguments_text(arguments)


def _held_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class _JsonSpan:
    """Finds where the JSON object or array opening at `start` of a growing text closes,
    counting its own kind of bracket outside strings. The text may grow between calls."""

    def __init__(self, start: int, opener: str) -> None:
        self.pos = start
        self.opener = opener
        self.closer = "}" if opener == "{" else "]"
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def advance(self, text: str) -> int | None:
        """The end (exclusive) of the span once `text` holds it; None while it is open."""
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c == self.opener:
                self.depth += 1
            elif c == self.closer:
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return None


class _TrimmedContent:
    """Passes content through without its leading whitespace, holding back trailing whitespace
    until more content follows: the pieces given out concatenate to the content, stripped."""

    def __init__(self) -> None:
        self.started = False
        self.held = ""

    def feed(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.held + text
        kept = text.rstrip()
        self.held = text[len(kept) :]
        return kept


# ---- streams ----


class ToolCallStream(ABC):
    """Parses one output arriving in fragments: `push` each fragment, then `finish` once."""

    def __init__(self) -> None:
        self._content = _TrimmedContent()
        self._calls = 0
        self._pending_text: list[str] = []
        self._pending_calls: list[ToolCallDelta] = []

    def push(self, text: str) -> ParsedDelta:
        """The content and call pieces that `text` (appended to the output) completes."""
        self._consume(text, final=False)
        return self._release()

    def finish(self) -> ParsedDelta:
        """What was held back, now that the output has ended."""
        self._consume("", final=True)
        return self._release()

    @abstractmethod
    def _consume(self, text: str, *, final: bool) -> None:
        """Append `text`; hand out (via _text and _call) whatever is now decided."""

    def _text(self, text: str) -> None:
        self._pending_text.append(self._content.feed(text))

    def _call(self, name: str, arguments: str) -> None:
        index = self._calls
        self._calls += 1
        self._pending_calls.append(ToolCallDelta(index, new_call_id(), name, ""))
        self._pending_calls.append(ToolCallDelta(index, None, None, arguments))

    def _release(self) -> ParsedDelta:
        delta = ParsedDelta("".join(self._pending_text), tuple(self._pending_calls))
        self._pending_text.clear()
        self._pending_calls.clear()
        return delta


class _HermesStream(ToolCallStream):
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._inside = False
        self._scanned = 0  # how far into _buf a closing tag was looked for
        # The JSON object a block opens with: a closing tag inside one of its strings is text.
        self._span: _JsonSpan | None = None
        self._span_end: int | None = None

    def _consume(self, text: str, *, final: bool) -> None:
        self._buf += text
        while self._close_block(final) if self._inside else self._open_block(final):
            pass

    def _open_block(self, final: bool) -> bool:
        start = self._buf.find(self.OPEN)
        if start < 0:
            keep = 0 if final else _held_length(self._buf, self.OPEN)
            self._text(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        self._text(self._buf[:start])
        self._buf = self._buf[start + len(self.OPEN) :]
        self._inside = True
        self._scanned = 0
        self._span, self._span_end = None, None
        return True

    def _closing_tag(self, final: bool) -> int:
        """Where the block's closing tag starts (-1: not yet, or never): the first one after
        the JSON object the block opens with, else (an object that never closes, at the end
        of the output) the first one."""
        body = self._buf
        first = len(body) - len(body.lstrip())
        if self._span is None and first < len(body) and body[first] == "{":
            self._span = _JsonSpan(first, "{")
        if self._span is not None and self._span_end is None:
            self._span_end = self._span.advance(body)
        begin = max(0, self._scanned - len(self.CLOSE) + 1)
        if self._span_end is not None:
            begin = max(begin, self._span_end)
        elif self._span is not None and not final:
            self._scanned = 0
            return -1
        end = body.find(self.CLOSE, begin if self._span_end is not None or not final else 0)
        if end < 0:
            self._scanned = len(body)
        return end

    def _close_block(self, final: bool) -> bool:
        end = self._closing_tag(final)
        if end < 0 and not final:
            return False
        if end < 0:  # the output ended inside the block: a call if its JSON is whole
            body = self._buf[: len(self._buf) - _held_length(self._buf, self.CLOSE)]
            raw, rest = self.OPEN + self._buf, ""
        else:
            body = self._buf[:end]
            raw, rest = self.OPEN + body + self.CLOSE, self._buf[end + len(self.CLOSE) :]
        call = _call_from_object(_load_json(body.strip()), ("arguments",), required=False)
        if call is None:
            self._text(raw)
        else:
            self._call(*call)
        self._buf = rest
        self._inside = False
        return end >= 0


class _Llama3Stream(ToolCallStream):
    TAG = "<|python_tag|>"
    KEYS = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        # Text not yet given out: the output so far until the first call, then what follows the
        # last call. "start": undecided; "object": a call's JSON is open; "between": after a
        # call, waiting for "; {"; "content": the rest passes through as content.
        self._buf = ""
        self._state = "start"
        self._span = _JsonSpan(0, "{")
        self._object_start = 0

    def _consume(self, text: str, *, final: bool) -> None:
        if self._state == "content":
            self._text(text)
            return
        self._buf += text
        while self._state != "content" and self._step():
            pass
        if final and self._buf:  # undecided or unfinished: it is content
            self._to_content()

    def _to_content(self) -> None:
        self._text(self._buf)
        self._buf = ""
        self._state = "content"

    def _open_object(self, start: int) -> bool:
        self._object_start = start
        self._span = _JsonSpan(start, "{")
        self._state = "object"
        return True

    def _step(self) -> bool:
        if self._state == "start":
            start = self._first_object(self._buf)
            if start is None:
                return False
            if start < 0:
                self._to_content()
                return False
            return self._open_object(start)
        if self._state == "between":
            return self._next_object()
        end = self._span.advance(self._buf)
        if end is None:
            return False
        call = _call_from_object(
            _load_json(self._buf[self._object_start : end]), self.KEYS, required=True
        )
        if call is None:
            self._to_content()
            return False
        self._call(*call)
        self._buf = self._buf[end:]
        self._state = "between"
        return True

    def _first_object(self, text: str) -> int | None:
        """Where the first call's `{` is; -1 when the output is not calls; None: undecided."""
        body = text.lstrip()
        if not body:
            return None
        if body.startswith("{"):
            return len(text) - len(body)
        if not body.startswith(self.TAG):
            return None if self.TAG.startswith(body) else -1
        after = body[len(self.TAG) :].lstrip()
        if not after:
            return None
        return len(text) - len(after) if after.startswith("{") else -1

    def _next_object(self) -> bool:
        body = self._buf.lstrip()
        if not body:
            return False
        if not body.startswith(";"):
            self._to_content()
            return False
        after = body[1:].lstrip()
        if not after:
            return False
        if not after.startswith("{"):
            self._to_content()
            return False
        return self._open_object(len(self._buf) - len(after))


class _MistralStream(ToolCallStream):
    TAG = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")

    def __init__(self) -> None:
        super().__init__()
        # "text": content, looking for the tag; "tag": just after it, the form undecided;
        # "array": a JSON array of calls is open; "args": NAME[ARGS] read, its object open.
        self._buf = ""  # after the tag when not in "text"
        self._state = "text"
        self._span = _JsonSpan(0, "[")
        self._span_start = 0
        self._name = ""

    def _consume(self, text: str, *, final: bool) -> None:
        self._buf += text
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        if self._state == "text":
            return self._find_tag(final)
        progress = self._read_form() if self._state == "tag" else self._close_span()
        if not progress and final and self._state != "text":
            self._give_up()
            return True
        return progress

    def _find_tag(self, final: bool) -> bool:
        start = self._buf.find(self.TAG)
        if start < 0:
            keep = 0 if final else _held_length(self._buf, self.TAG)
            self._text(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        self._text(self._buf[:start])
        self._buf = self._buf[start + len(self.TAG) :]
        self._state = "tag"
        return True

    def _give_up(self) -> None:
        """The tag opened no call: it is content, and the text after it is read again."""
        self._text(self.TAG)
        self._state = "text"

    def _open_span(self, start: int, opener: str, state: str) -> bool:
        self._span_start = start
        self._span = _JsonSpan(start, opener)
        self._state = state
        return True

    def _read_form(self) -> bool:
        body = self._buf.lstrip()
        if not body:
            return False
        if body.startswith("["):
            return self._open_span(len(self._buf) - len(body), "[", "array")
        bracket = self._buf.find("[")
        name = self._buf if bracket < 0 else self._buf[:bracket]
        if not set(name) <= self.NAME_CHARS:
            self._give_up()
            return True
        if bracket < 0 or self.ARGS.startswith(self._buf[bracket:]):
            return False  # the name, or "[ARGS]", is still arriving
        if not name or not self._buf.startswith(self.ARGS, bracket):
            self._give_up()
            return True
        after = self._buf[bracket + len(self.ARGS) :]
        if not after.lstrip():
            return False
        if not after.lstrip().startswith("{"):
            self._give_up()
            return True
        self._name = name
        return self._open_span(len(self._buf) - len(after.lstrip()), "{", "args")

    def _close_span(self) -> bool:
        end = self._span.advance(self._buf)
        if end is None:
            return False
        value = _load_json(self._buf[self._span_start : end])
        calls: list[tuple[str, str]] | None
        if self._state == "args":
            one = _call_from_object(
                {"name": self._name, "arguments": value}, ("arguments",), required=True
            )
            calls = None if one is None else [one]
        else:
            calls = self._array_calls(value)
        if calls is None:
            self._give_up()
            return True
        for call in calls:
            self._call(*call)
        self._buf = self._buf[end:]
        self._state = "text"
        return True

    @staticmethod
    def _array_calls(value: object) -> list[tuple[str, str]] | None:
        if not isinstance(value, list) or not value:
            return None
        calls = [_call_from_object(item, ("arguments",), required=False) for item in value]
        if any(call is None for call in calls):
            return None
        return [call for call in calls if call is not None]


# ---- parsers ----

# llguidance's JSON options: the spacing the models were trained on (json.dumps's ", " and ": "),
# no other whitespace (a model held to a schema can otherwise emit whitespace without end), and
# schema keywords llguidance does not implement ignored rather than refused.
_JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
}


def _call_schema(function: ToolFunction, arguments_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, arguments_key: function.parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _any_call_schema(functions: Sequence[ToolFunction], arguments_key: str) -> dict[str, Any]:
    if not functions:
        raise RequestError("tools", [], "a grammar for tool calls needs at least one function")
    return {"anyOf": [_call_schema(function, arguments_key) for function in functions]}


def _json_rule(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS}, ensure_ascii=False)


def _collect(deltas: Sequence[ParsedDelta]) -> tuple[str | None, list[ToolCall]]:
    """extract's answer from a stream's deltas."""
    content = "".join(delta.content for delta in deltas)
    heads: dict[int, tuple[str, str]] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.id is not None and piece.name is not None:
                heads[piece.index] = (piece.id, piece.name)
            arguments.setdefault(piece.index, []).append(piece.arguments)
    calls = [ToolCall(*heads[i], "".join(arguments[i])) for i in sorted(heads)]
    return content or None, calls


class ToolParser(ABC):
    """One tool-call format: `--tool-call-parser NAME`."""

    name: ClassVar[str]

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output's content outside the calls (stripped; None when empty) and its
        calls. Never raises: text that is not a well-formed call stays content."""
        stream = self.stream()
        return _collect([stream.push(text), stream.finish()])

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A parser for one output arriving in fragments."""

    @abstractmethod
    def grammar(self, functions: Sequence[ToolFunction], *, parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect, JSON schemas inlined with `%json`) that forces
        one call in this format, or one or more when `parallel`: each names one of `functions`
        and its arguments validate against that function's `parameters`."""


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self) -> ToolCallStream:
        return _HermesStream()

    def grammar(self, functions: Sequence[ToolFunction], *, parallel: bool) -> str:
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return "\n".join(
            [
                start,
                'call: "<tool_call>\\n" function "\\n</tool_call>"',
                "function: " + _json_rule(_any_call_schema(functions, "arguments")),
                "",
            ]
        )


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> ToolCallStream:
        return _Llama3Stream()

    def grammar(self, functions: Sequence[ToolFunction], *, parallel: bool) -> str:
        # Without <|python_tag|>: it is a special token in Llama's tokenizer and optional here.
        start = 'start: function ("; " function)*' if parallel else "start: function"
        rule = "function: " + _json_rule(_any_call_schema(functions, "parameters"))
        return "\n".join([start, rule, ""])


class MistralToolParser(ToolParser):
    name = "mistral"

    def stream(self) -> ToolCallStream:
        return _MistralStream()

    def grammar(self, functions: Sequence[ToolFunction], *, parallel: bool) -> str:
        # The array form, with [TOOL_CALLS] as text: a tokenizer that holds it as one special
        # token needs the rule to name that token instead.
        schema: dict[str, Any] = {
            "type": "array",
            "items": _any_call_schema(functions, "arguments"),
            "minItems": 1,
        }
        if not parallel:
            schema["maxItems"] = 1
        return "\n".join(['start: "[TOOL_CALLS]" calls', "calls: " + _json_rule(schema), ""])


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def tool_parser(name: str) -> ToolParser:
    """The parser `--tool-call-parser NAME` names."""
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        raise ConfigError("--tool-call-parser", name, "choose one of " + ", ".join(TOOL_PARSERS))
    return parser()


# ---- prompts for chat templates without tool support ----

_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def render_tools_prompt(functions: Sequence[ToolFunction]) -> str:
    """The system text that offers `functions` in hermes form, as Qwen2.5's template writes it
    (one `{"type": "function", "function": {...}}` per line inside <tools></tools>)."""
    lines = []
    for function in functions:
        body: dict[str, Any] = {"name": function.name}
        if function.description is not None:
            body["description"] = function.description
        body["parameters"] = function.parameters
        lines.append(json.dumps({"type": "function", "function": body}, ensure_ascii=False))
    return _TOOLS_HEAD + "".join("\n" + line for line in lines) + _TOOLS_TAIL


def tool_call_text(calls: Sequence[ToolCall]) -> str:
    """An assistant message's earlier calls in hermes form, one block per call, joined by
    newlines (a message with content puts it first, then a newline). Arguments that are not a
    JSON object are written as a JSON string."""
    blocks = []
    for call in calls:
        arguments = _load_json(call.arguments)
        value = arguments if isinstance(arguments, dict) else call.arguments
        body = {"name": call.name, "arguments": value}
        blocks.append(f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>")
    return "\n".join(blocks)
