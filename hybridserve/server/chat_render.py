"""A chat request's conversation as its chat template reads it: tool definitions, an assistant
turn's earlier tool calls and tool results.

A template that renders tools itself (Qwen3, Qwen3-Next, Hermes, SmolLM3, Llama 3.1: its
source mentions `tools`) gets them as transformers and vLLM give them: `tools` as OpenAI tool
definitions, an assistant turn's `tool_calls` with their arguments parsed into objects, tool
turns with `role: "tool"` and their `tool_call_id`.

A template that does not (SmolLM2, the simulator's plain template) gets the hermes convention
written into the conversation, as Qwen2.5's template writes it: the tool definitions and how
to call them appended to the system message (one is added first when the conversation has
none), earlier calls as `<tool_call>` blocks in the assistant's text, and each run of tool
results as one user turn of `<tool_response>` blocks. The hermes tool parser reads the calls
back either way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from hybridserve.server.tokenizer import ChatMessage
from hybridserve.server.tool_parsers import (
    ToolCall,
    ToolFunction,
    render_tools_prompt,
    tool_call_text,
)


def tool_definitions(functions: Sequence[ToolFunction]) -> list[dict[str, Any]]:
    """OpenAI tool definitions, as templates read `tools`."""
    out = []
    for f in functions:
        function: dict[str, Any] = {"name": f.name, "parameters": f.parameters}
        if f.description is not None:
            function["description"] = f.description
        out.append({"type": "function", "function": function})
    return out


def template_call(call: ToolCall) -> dict[str, Any]:
    """An earlier tool call as templates read it: arguments parsed into an object (vLLM does
    the same), kept as text when they are not a JSON object."""
    arguments: Any = call.arguments
    try:
        parsed = json.loads(call.arguments)
    except json.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        arguments = parsed
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    }


def conversation(
    messages: Sequence[ChatMessage],
    calls: Sequence[Sequence[ToolCall]],
    functions: Sequence[ToolFunction],
    *,
    native: bool,
) -> tuple[list[ChatMessage], list[dict[str, Any]] | None]:
    """(messages, tools) for the template. `calls[i]` are message i's tool calls (empty for
    most); `functions` the request's tools (empty: none offered); `native`: the template
    renders tools itself."""
    if native:
        out = [
            ChatMessage(
                m.role,
                m.content,
                tuple(template_call(c) for c in turn_calls),
                m.tool_call_id,
                m.name,
            )
            for m, turn_calls in zip(messages, calls, strict=True)
        ]
        return out, tool_definitions(functions) or None
    return _written_in(messages, calls, functions), None


def _written_in(
    messages: Sequence[ChatMessage],
    calls: Sequence[Sequence[ToolCall]],
    functions: Sequence[ToolFunction],
) -> list[ChatMessage]:
    """The hermes convention written into plain role/content turns."""
    out: list[ChatMessage] = []
    responses: list[str] = []

    def close_responses() -> None:
        if responses:
            out.append(ChatMessage("user", "\n".join(responses)))
            responses.clear()

    for message, turn_calls in zip(messages, calls, strict=True):
        if message.role == "tool":
            responses.append(f"<tool_response>\n{message.content}\n</tool_response>")
            continue
        close_responses()
        content = message.content
        if turn_calls:
            written = tool_call_text(turn_calls)
            content = f"{content}\n{written}" if content else written
        out.append(ChatMessage(message.role, content))
    close_responses()
    if functions:
        prompt = render_tools_prompt(functions)
        if out and out[0].role == "system":
            out[0] = ChatMessage("system", f"{out[0].content}\n\n{prompt}")
        else:
            out.insert(0, ChatMessage("system", prompt))
    return out
