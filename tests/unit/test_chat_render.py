"""A conversation with tools as its chat template reads it: natively (tools, tool_calls with
parsed arguments, tool turns) or in the hermes convention written into plain turns."""

from __future__ import annotations

from hybridserve.server.chat_render import conversation
from hybridserve.server.tokenizer import ChatMessage
from hybridserve.server.tool_parsers import ToolCall, ToolFunction

CALC = ToolFunction("calc", "Evaluate", {"type": "object", "properties": {"e": {"type": "string"}}})
MESSAGES = [
    ChatMessage("user", "2+2?"),
    ChatMessage("assistant", ""),
    ChatMessage("tool", "4", tool_call_id="call_1"),
    ChatMessage("tool", "5", tool_call_id="call_2"),
    ChatMessage("user", "and?"),
]
CALLS: list[list[ToolCall]] = [
    [],
    [ToolCall("call_1", "calc", '{"e": "2+2"}'), ToolCall("call_2", "calc", "not json")],
    [],
    [],
    [],
]


def test_a_template_with_tool_support_gets_tools_and_parsed_arguments() -> None:
    messages, tools = conversation(MESSAGES, CALLS, [CALC], native=True)
    assert tools == [
        {
            "type": "function",
            "function": {"name": "calc", "parameters": CALC.parameters, "description": "Evaluate"},
        }
    ]
    calls = messages[1].template_dict()["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"e": "2+2"}
    assert calls[1]["function"]["arguments"] == "not json"  # kept as text
    assert messages[2].template_dict() == {"role": "tool", "content": "4", "tool_call_id": "call_1"}


def test_a_template_without_tool_support_gets_the_hermes_convention_written_in() -> None:
    messages, tools = conversation(MESSAGES, CALLS, [CALC], native=False)
    assert tools is None
    assert [m.role for m in messages] == ["system", "user", "assistant", "user", "user"]
    assert messages[0].content.startswith("# Tools") and '"name": "calc"' in messages[0].content
    assert messages[2].content.startswith(
        '<tool_call>\n{"name": "calc", "arguments": {"e": "2+2"}}'
    )
    assert messages[3].content == (
        "<tool_response>\n4\n</tool_response>\n<tool_response>\n5\n</tool_response>"
    )
    kept, _ = conversation([ChatMessage("system", "Be brief."), *MESSAGES], [[], *CALLS], [CALC],
                           native=False)  # fmt: skip
    assert kept[0].content.startswith("Be brief.\n\n# Tools") and len(kept) == 5


def test_no_tools_leaves_the_conversation_as_it_is() -> None:
    plain = [ChatMessage("user", "hi")]
    assert conversation(plain, [[]], [], native=False) == (plain, None)
    assert conversation(plain, [[]], [], native=True) == (plain, None)


def test_a_tool_without_parameters_is_a_function_of_no_arguments() -> None:
    from hybridserve.server.chat import functions_of
    from hybridserve.server.protocol import ToolModel

    tools = [
        ToolModel.model_validate({"type": "function", "function": {"name": "now"}}),
        ToolModel.model_validate(
            {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}
        ),
    ]
    assert functions_of(tools) == [
        ToolFunction("now", None, {"type": "object", "properties": {}}),
        ToolFunction("w", None, {"type": "object"}),
    ]
