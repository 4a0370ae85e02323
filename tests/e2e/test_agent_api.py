"""What agent clients send, through the HTTP API with the real `openai` client, on the torch
executor with the built-in SmolLM2-135M (skipped when `models/smollm2` is absent): tool calls
(forced, named and streamed, parallel, a tool result turn), structured outputs (a strict JSON
schema validated with `jsonschema`, a regex, a choice), and the errors that name the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch executor needs the torch extra")
pytest.importorskip("llguidance", reason="structured outputs need llguidance")
jsonschema = pytest.importorskip("jsonschema", reason="responses are validated with jsonschema")

from openai import BadRequestError, OpenAI  # noqa: E402

from hybridserve.cli.serve_commands import build_app  # noqa: E402
from hybridserve.server.app import ServerSettings  # noqa: E402
from hybridserve.server.reasoning import reasoning_parser  # noqa: E402
from hybridserve.server.tool_parsers import HermesToolParser, ToolFunction  # noqa: E402
from tests.e2e.conftest import LiveServer, serve_in_thread  # noqa: E402

MODEL = "smollm2"
CALCULATOR = {
    "type": "object",
    "properties": {"expression": {"type": "string", "maxLength": 24}},
    "required": ["expression"],
    "additionalProperties": False,
}
READ_FILE = {
    "type": "object",
    "properties": {"path": {"type": "string", "maxLength": 24}},
    "required": ["path"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression",
            "parameters": CALCULATOR,
        },
    },
    {
        "type": "function",
        "function": {"name": "read_file", "description": "Read a file", "parameters": READ_FILE},
    },
]
SCHEMAS = {"calculator": CALCULATOR, "read_file": READ_FILE}


@pytest.fixture(scope="module")
def agent_server() -> Iterator[LiveServer]:
    from hybridserve.executor.torch.checkpoints import builtin_path
    from hybridserve.server.torch_backend import TorchServingBackend

    path = builtin_path(MODEL)
    if not path.exists():
        pytest.skip(f"{path} is absent (make models fetches it)")
    torch.set_num_threads(1)
    backend = TorchServingBackend(str(path), name=MODEL, device="cpu", max_model_len=1024)
    server = serve_in_thread(build_app(backend, ServerSettings(), preset_name="baseline"))
    yield server
    server.stop()


def _client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


def _ask(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def _check_call(call: Any) -> dict[str, Any]:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments  # type: ignore[no-any-return]


def test_tool_choice_required_returns_a_valid_call(agent_server: LiveServer) -> None:
    reply = _client(agent_server).chat.completions.create(
        model=MODEL,
        messages=_ask("What is 12 times 7?"),
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].id.startswith("call_")
    _check_call(calls[0])


def test_named_tool_choice_streams_openai_tool_call_deltas(agent_server: LiveServer) -> None:
    stream = _client(agent_server).chat.completions.create(
        model=MODEL,
        messages=_ask("Show me notes.txt"),
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "read_file"}},
        max_tokens=64,
        temperature=0,
        stream=True,
    )
    deltas, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            deltas.extend(choice.delta.tool_calls or [])
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert deltas[0].id is not None and deltas[0].function.name == "read_file"
    assert all(d.index == 0 for d in deltas) and all(d.id is None for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), READ_FILE)


def test_two_calls_in_one_turn_come_back_as_parallel_tool_calls(agent_server: LiveServer) -> None:
    # A grammar that forces two hermes calls: the server reads both back as tool_calls.
    functions = [
        ToolFunction(t["function"]["name"], None, t["function"]["parameters"]) for t in TOOLS
    ]
    grammar = HermesToolParser().grammar(functions, parallel=True)
    grammar = grammar.replace('start: call ("\\n" call)*', 'start: call "\\n" call')
    reply = _client(agent_server).chat.completions.create(
        model=MODEL,
        messages=_ask("Compute 2+2 and read a.txt"),
        tools=TOOLS,
        max_tokens=96,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    calls = reply.choices[0].message.tool_calls or []
    assert len(calls) == 2 and reply.choices[0].finish_reason == "tool_calls"
    assert len({c.id for c in calls}) == 2
    for call in calls:
        _check_call(call)


def test_a_tool_result_turn_is_served_and_the_session_hits_the_cache(
    agent_server: LiveServer,
) -> None:
    client = _client(agent_server)
    messages = _ask("What is 12 times 7?")
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=64,
        parallel_tool_calls=False, temperature=0,
    )  # fmt: skip
    call = (first.choices[0].message.tool_calls or [])[0]
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "84"},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length")
    usage = second.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    # The turn repeats the first turn's prompt: its full blocks come from the cache.
    assert first.usage is not None
    assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16 - 16
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_json_schema_strict_output_validates(agent_server: LiveServer) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    client = _client(agent_server)
    for stream in (False, True):
        kwargs: dict[str, Any] = dict(
            model=MODEL,
            messages=_ask("Name a big city and its population."),
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": schema, "strict": True},
            },
            max_tokens=40,
            temperature=0,
        )
        if stream:
            chunks = client.chat.completions.create(**kwargs, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content or ""
        jsonschema.validate(json.loads(text), schema)


def test_regex_and_choice_constrain_the_output(agent_server: LiveServer) -> None:
    client = _client(agent_server)
    dated = client.chat.completions.create(
        model=MODEL,
        messages=_ask("When did it happen?"),
        max_tokens=16,
        temperature=0,
        extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"},
    )
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", dated.choices[0].message.content or "")
    answer = client.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer:",
        max_tokens=8,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    )
    assert answer.choices[0].text in ("yes", "no", "maybe")
    assert answer.choices[0].finish_reason == "stop"


def test_json_object_output_is_an_object(agent_server: LiveServer) -> None:
    reply = _client(agent_server).chat.completions.create(
        model=MODEL,
        messages=_ask("Describe a cat as JSON."),
        response_format={"type": "json_object"},
        max_tokens=64,
        temperature=0,
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    else:  # cut at max_tokens: a prefix of an object
        assert (reply.choices[0].message.content or "").startswith("{")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "b"}, "tool_choice"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"guided_choice": ["a", "b"], "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_its_field(
    agent_server: LiveServer, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequestError) as caught:
        _client(agent_server).chat.completions.create(
            model=MODEL, messages=_ask("hi"), max_tokens=4, extra_body=extra
        )
    assert caught.value.body is not None
    assert caught.value.body["param"] == param  # type: ignore[index]


def test_logit_bias_and_min_tokens_shape_the_output(agent_server: LiveServer) -> None:
    tokenizer = agent_server.state.tokenizer
    eos = tokenizer.eos_token_ids[0]
    client = _client(agent_server)
    ended = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
        logit_bias={str(eos): 100},
    )  # fmt: skip
    assert ended.usage is not None and ended.usage.completion_tokens == 1
    held = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
        logit_bias={str(eos): 100}, extra_body={"min_tokens": 5},
    )  # fmt: skip
    assert held.usage is not None and held.usage.completion_tokens == 6  # 5, then the stop


def test_reasoning_is_split_into_reasoning_content(agent_server: LiveServer) -> None:
    state = agent_server.state
    state.reasoning_parser = reasoning_parser("deepseek_r1")
    try:
        reply = _client(agent_server).chat.completions.create(
            model=MODEL,
            messages=_ask("Think, then answer."),
            max_tokens=24,
            temperature=0,
            extra_body={"guided_regex": r"<think>[a-z ]{1,12}</think>(yes|no)"},
        )
    finally:
        state.reasoning_parser = None
    message = reply.choices[0].message.model_dump()
    assert message["content"] in ("yes", "no")
    assert re.fullmatch(r"[a-z ]{1,12}", message["reasoning_content"])


def test_n_seeded_choices_differ_from_each_other_and_repeat(agent_server: LiveServer) -> None:
    client = _client(agent_server)

    def texts() -> list[str]:
        reply = client.completions.create(
            model=MODEL, prompt="My favourite food is", max_tokens=6, temperature=1.0, n=3,
            seed=11,
        )  # fmt: skip
        return [c.text for c in reply.choices]

    first = texts()
    assert len(set(first)) > 1 and texts() == first


def test_the_docs_agent_loop_runs_and_its_later_turns_hit_the_cache(
    agent_server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "agents_api.md").read_text()
    (script,) = re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
    assert "http://127.0.0.1:8000/v1" in script
    exec(script.replace("http://127.0.0.1:8000/v1", agent_server.api_url), {})
    printed = capsys.readouterr().out
    cached = [int(n) for n in re.findall(r"turn \d: (\d+) of \d+ prompt tokens cached", printed)]
    assert len(cached) == 3 and cached[1] > 0 and cached[2] > cached[1], printed
    assert printed.count(" -> ") == 2  # one tool result per forced turn


def test_the_openai_sdks_structured_output_and_tool_helpers_run_unchanged(
    agent_server: LiveServer,
) -> None:
    import openai
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        population: int

    class Calculator(BaseModel):
        """Evaluate an arithmetic expression"""

        expression: str = Field(max_length=30)

    client = _client(agent_server)
    common: dict[str, Any] = {"model": MODEL, "max_tokens": 60, "temperature": 0}
    parsed = client.chat.completions.parse(
        messages=_ask("Name a big city."), response_format=City, **common
    )
    assert isinstance(parsed.choices[0].message.parsed, City)
    tools = [openai.pydantic_function_tool(Calculator)]
    called = client.chat.completions.parse(
        messages=_ask("What is 3*4?"), tools=tools, tool_choice="required", **common
    )
    (call,) = called.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Calculator)
    with client.chat.completions.stream(
        messages=_ask("What is 3*4?"), tools=tools, tool_choice="required", **common
    ) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in kinds
    (streamed,) = final.choices[0].message.tool_calls or []
    assert streamed.function.parsed_arguments == call.function.parsed_arguments
