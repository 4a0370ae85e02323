"""What a chat request asks beyond sampling, resolved before anything is queued: the
conversation and tools for the template, the structured output that constrains it (a
`response_format`, vLLM's `structured_outputs` / `guided_*`, or a tool choice that forces a
call), how its output is read back (reasoning, tool calls), and the session it belongs to.

Sessions: the id tool-call pinning and exact tails key by is, in order, the request's `user`,
its `X-Session-Id` header, or (for a chat) a digest of the conversation up to its first user
turn, which every later turn of an agent's conversation repeats. Either way it is scoped by
`cache_salt` and kept as a fixed-size digest by the engine.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers

from hybridserve.core.errors import HybridServeError
from hybridserve.core.request import StructuredOutput
from hybridserve.executor.grammar import Grammars
from hybridserve.server.chat_render import conversation
from hybridserve.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    ChatMessageModel,
    CompletionRequest,
    NamedToolChoice,
    ToolModel,
)
from hybridserve.server.reasoning import ReasoningParser
from hybridserve.server.tokenizer import TEMPLATE_VARIABLES, ChatMessage, Tokenizer
from hybridserve.server.tool_parsers import (
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    ToolFunction,
    ToolParser,
)

SESSION_HEADER = "x-session-id"
MAX_SESSION_BYTES = 1024
CONVERSATION_SESSION_PREFIX = "conv-"


@dataclass(frozen=True, slots=True)
class ChatDelta:
    """What one piece of a chat output adds: content, reasoning and tool-call pieces."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


class ChatOutput:
    """Reads one chat choice's output back: `<think>` reasoning split off first (with a
    reasoning parser), then tool calls (when the request offered tools)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._reasoning_stream = reasoning.stream() if reasoning is not None else None
        self._tool_stream = tools.stream() if tools is not None else None
        self.called = False  # a tool call was read

    @property
    def reads_reasoning(self) -> bool:
        """Whether reasoning is split off (responses then carry `reasoning_content`)."""
        return self._reasoning is not None

    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(content, reasoning, calls) of a whole output."""
        reasoning: str | None = None
        content: str | None = text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.split(text)
        calls: list[ToolCall] = []
        if self._tools is not None and content:
            content, calls = self._tools.extract(content)
        self.called = bool(calls)
        return content, reasoning, calls

    def push(self, text: str) -> ChatDelta:
        return self._delta(text, final=False)

    def finish(self) -> ChatDelta:
        return self._delta("", final=True)

    def _delta(self, text: str, *, final: bool) -> ChatDelta:
        reasoning, content = "", text
        if self._reasoning_stream is not None:
            if text:
                reasoning, content = self._reasoning_stream.push(text)
            if final:
                more_reasoning, more_content = self._reasoning_stream.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self._tool_stream is None:
            return ChatDelta(content, reasoning)
        parsed = self._tool_stream.push(content) if content else ParsedDelta("", ())
        if final:
            rest = self._tool_stream.finish()
            parsed = ParsedDelta(parsed.content + rest.content, parsed.tool_calls + rest.tool_calls)
        self.called = self.called or bool(parsed.tool_calls)
        return ChatDelta(parsed.content, reasoning, parsed.tool_calls)


def chat_messages(
    messages: Sequence[ChatMessageModel],
) -> tuple[list[ChatMessage], list[list[ToolCall]]]:
    """The request's messages for the template, and each one's earlier tool calls."""
    out: list[ChatMessage] = []
    calls: list[list[ToolCall]] = []
    for i, m in enumerate(messages):
        text = valid_unicode(m.text(), f"messages.{i}.content")
        role = "system" if m.role == "developer" else m.role
        out.append(ChatMessage(role, text, (), m.tool_call_id, m.name))
        calls.append(
            [ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
        )
    return out, calls


def request_functions(body: ChatCompletionRequest) -> list[ToolFunction]:
    """The request's tools. The template sees them even with `tool_choice: "none"` (as vLLM
    renders them by default), so a turn that may not call keeps the prompt prefix of the turns
    that may, and its cached blocks; its output is then not read for calls."""
    return functions_of(body.tools)


def functions_of(tools: Sequence[ToolModel]) -> list[ToolFunction]:
    """Validated tool definitions as functions (no `parameters`: an object of no properties)."""
    return [
        ToolFunction(t.function.name, t.function.description, t.function.parameters)
        if t.function.parameters is not None
        else ToolFunction(t.function.name, t.function.description)
        for t in tools
    ]


def structured_output(
    body: CompletionRequest | ChatCompletionRequest,
    grammars: Grammars | None,
    executor_name: str,
    *,
    tool_parser: ToolParser | None = None,
) -> StructuredOutput | None:
    """The one constraint on the request's output, checked against the model's tokenizer: a
    400 naming the field when two are given, when the executor has no tokenizer to constrain,
    or when the grammar does not compile."""
    fields = body.structured_fields()
    if isinstance(body, ChatCompletionRequest) and tool_parser is not None:
        fields += _forced_call(body, tool_parser)
    if not fields:
        return None
    field, structured = fields[0]
    if body.ignore_eos:
        raise ApiError(
            400,
            f"ignore_eos: a structured output ({field}) ends where its grammar completes, with "
            "the end-of-sequence token; leave ignore_eos out",
            param="ignore_eos",
        )
    if len(fields) > 1:
        second = fields[1][0]
        raise ApiError(
            400,
            f"{second}: give one structured-output constraint; {field} is given too",
            param=second,
        )
    if grammars is None:
        raise ApiError(
            400,
            f"{field}: the {executor_name} executor has no tokenizer to constrain its output; "
            "leave it out, or serve a model (--executor torch)",
            param=field,
        )
    error = grammars.check(structured)
    if error is not None:
        raise ApiError(400, f"{field}: {error}", param=field, code="invalid_grammar")
    return structured


def _forced_call(
    body: ChatCompletionRequest, parser: ToolParser
) -> list[tuple[str, StructuredOutput]]:
    """tool_choice "required" or a named function: a grammar that forces a call in the
    parser's format (the named function only; several calls only with parallel_tool_calls)."""
    choice = body.effective_tool_choice()
    if choice not in ("required", "named"):
        return []
    functions = request_functions(body)
    if isinstance(body.tool_choice, NamedToolChoice):
        name = body.tool_choice.function.name
        functions = [f for f in functions if f.name == name]
    parallel = choice == "required" and body.parallel_tool_calls
    try:
        grammar = parser.grammar(functions, parallel=parallel)
    except ValueError as exc:
        raise ApiError(400, f"tools: {exc}", param="tools") from None
    return [("tool_choice", StructuredOutput("lark", grammar))]


def session_id(
    body: CompletionRequest | ChatCompletionRequest,
    headers: Headers,
    messages: Sequence[ChatMessage] = (),
) -> str | None:
    """The session the request belongs to: `user`, else the `X-Session-Id` header, else (a
    chat) a digest of the conversation up to its first user turn; None for a completion
    that names none."""
    if body.user:
        return body.user
    header = headers.get(SESSION_HEADER)
    if header is not None:
        if not header or len(header.encode()) > MAX_SESSION_BYTES:
            raise ApiError(
                400,
                f"X-Session-Id: give 1 to {MAX_SESSION_BYTES} bytes (got {len(header.encode())})",
                param="X-Session-Id",
            )
        return header
    if not messages:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for m in messages:
        digest.update(json.dumps([m.role, m.content], ensure_ascii=False).encode())
        if m.role == "user":
            break
    return CONVERSATION_SESSION_PREFIX + digest.hexdigest()


def chat_prompt(
    tokenizer: Tokenizer,
    message_models: Sequence[ChatMessageModel],
    functions: Sequence[ToolFunction],
    template_kwargs: Mapping[str, Any],
) -> tuple[list[int], list[ChatMessage]]:
    """A conversation's prompt ids (tools and earlier calls written as the model's template
    reads them), and its messages."""
    messages, calls = chat_messages(message_models)
    reserved = sorted(set(template_kwargs) & TEMPLATE_VARIABLES)
    if reserved:
        raise ApiError(
            400,
            f"chat_template_kwargs: {', '.join(reserved)} is set by the request itself; "
            "leave it out of chat_template_kwargs",
            param="chat_template_kwargs",
        )
    rendered, tools = conversation(messages, calls, functions, native=tokenizer.supports_tools)
    prompt_ids = encode_checked(
        lambda: tokenizer.apply_chat_template(rendered, tools=tools, options=template_kwargs),
        "messages",
    )
    return prompt_ids, messages


def encode_checked(encode: Callable[[], list[int]], field: str) -> list[int]:
    """Token ids from `encode`, or a 400 naming `field` (text no tokenizer can encode, a
    template that refuses the conversation, an empty prompt)."""
    try:
        ids = encode()
    except UnicodeEncodeError:
        raise ApiError(400, f"{field}: text is not valid Unicode", param=field) from None
    except HybridServeError as exc:  # e.g. a chat template that rejects the conversation
        raise ApiError(400, f"{field}: {getattr(exc, 'fix', exc)}", param=field) from None
    if not ids:
        raise ApiError(400, f"{field}: the prompt is empty", param=field)
    return ids


def valid_unicode(text: str, field: str) -> str:
    """`text`, or a 400 naming `field` if it holds a lone surrogate (JSON's "\\udfff"), which
    no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(
            400,
            f"{field}: text is not valid Unicode (a lone surrogate at character {exc.start})",
            param=field,
        ) from None
    return text
