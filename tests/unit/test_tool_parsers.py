"""The tool-call parsers: calls and content of whole outputs, the same answer from any split of
an output into streamed fragments, malformed calls kept as content, and grammars that llguidance
accepts, that admit a well-formed call and refuse a wrong name or arguments."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.server.tool_parsers import (
    TOOL_PARSERS,
    ParsedDelta,
    ToolCall,
    ToolFunction,
    new_call_id,
    render_tools_prompt,
    tool_call_text,
    tool_parser,
)

HERMES = tool_parser("hermes")
LLAMA = tool_parser("llama3_json")
MISTRAL = tool_parser("mistral")


def calls_of(calls: Sequence[ToolCall]) -> list[tuple[str, Any]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def run_stream(parser_name: str, fragments: Sequence[str]) -> tuple[str, list[ParsedDelta]]:
    """The concatenated content and every delta of `fragments` pushed in turn, then finish."""
    stream = tool_parser(parser_name).stream()
    deltas = [stream.push(fragment) for fragment in fragments] + [stream.finish()]
    return "".join(delta.content for delta in deltas), deltas


def streamed_calls(deltas: Sequence[ParsedDelta]) -> list[tuple[str, str]]:
    """(name, arguments) per call index; each index's first delta alone has an id and name."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.index not in names:
                assert piece.id is not None and piece.id.startswith("call_")
                assert piece.name is not None
                names[piece.index] = piece.name
                arguments[piece.index] = piece.arguments
            else:
                assert piece.id is None and piece.name is None
                arguments[piece.index] += piece.arguments
    assert sorted(names) == list(range(len(names)))
    return [(names[i], arguments[i]) for i in range(len(names))]


def split_at(text: str, cuts: Sequence[int]) -> list[str]:
    points = sorted({min(cut, len(text)) for cut in cuts})
    edges = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(edges)]


# ---- whole outputs ----


def test_hermes_reads_calls_and_the_text_around_them() -> None:
    text = (
        "Let me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    content, calls = HERMES.extract(text)
    assert content == "Let me look."
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert calls[0].arguments == '{"city": "Paris"}'
    assert calls[0].id != calls[1].id


def test_hermes_output_without_calls_is_content() -> None:
    assert HERMES.extract("  Just an answer.\n") == ("Just an answer.", [])
    assert HERMES.extract("") == (None, [])


def test_hermes_malformed_call_stays_content_beside_a_good_one() -> None:
    bad = "<tool_call>\n{'name': 'get_weather'}\n</tool_call>"
    good = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    content, calls = HERMES.extract(bad + "\n" + good)
    assert content == bad
    assert calls_of(calls) == [("f", {"x": 1})]


@pytest.mark.parametrize(
    "body",
    [
        '{"name": 3, "arguments": {}}',
        '{"name": "", "arguments": {}}',
        '{"name": "f", "arguments": [1]}',
        '{"name": "f", "arguments": {"x": NaN}}',
        '{"name": "f", "arguments": {"x": 1e400}}',
        '["f"]',
        '{"name": "f", "arguments": {"x": 1}',
        "<function=f>{}</function>",
    ],
)
def test_hermes_block_that_is_not_a_call_stays_content_as_written(body: str) -> None:
    text = f"<tool_call>\n{body}\n</tool_call>"
    assert HERMES.extract(text) == (text, [])


def test_hermes_call_without_arguments_has_empty_arguments() -> None:
    _, calls = HERMES.extract('<tool_call>{"name": "now"}</tool_call>')
    assert calls_of(calls) == [("now", {})]


def test_hermes_arguments_given_as_a_json_string_are_read() -> None:
    _, calls = HERMES.extract('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert calls_of(calls) == [("f", {"a": 1})]


def test_hermes_call_cut_before_its_closing_tag_counts_when_its_json_is_whole() -> None:
    _, calls = HERMES.extract('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool')
    assert calls_of(calls) == [("f", {"a": 1})]
    cut = '<tool_call>\n{"name": "f", "arguments": {"a": '
    assert HERMES.extract(cut) == (cut.strip(), [])


def test_arguments_keep_unicode_unescaped() -> None:
    escaped = '"caf\\u00e9 \\u65e5\\u672c 🙂"'
    text = '<tool_call>{"name": "say", "arguments": {"text": ' + escaped + "}}</tool_call>"
    _, calls = HERMES.extract(text)
    assert calls[0].arguments == '{"text": "café 日本 🙂"}'
    assert json.loads(calls[0].arguments) == {"text": "café 日本 🙂"}


def test_a_lone_surrogate_in_arguments_stays_escaped() -> None:
    _, calls = HERMES.extract('<tool_call>{"name": "f", "arguments": {"s": "\\ud800"}}</tool_call>')
    assert calls[0].arguments == '{"s": "\\ud800"}'
    calls[0].arguments.encode("utf-8")


def test_llama3_json_reads_one_or_several_calls_with_or_without_the_python_tag() -> None:
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert calls_of(LLAMA.extract(one)[1]) == [("get_weather", {"city": "Paris"})]
    several = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}'
    content, calls = LLAMA.extract(several)
    assert content is None
    assert calls_of(calls) == [("a", {"x": 1}), ("b", {})]


@pytest.mark.parametrize(
    "text",
    [
        "The capital is Paris.",
        'As JSON: {"name": "a", "parameters": {}}',
        '{"name": "Bob", "age": 3}',
        '{"name": "a", "parameters": {}, "arguments": {}}',
        '{"name": "a", "parameters": {"x": 1}',
        '<|python_tag|>brave_search.call(query="x")',
    ],
)
def test_llama3_json_output_that_is_not_calls_is_content(text: str) -> None:
    assert LLAMA.extract(text) == (text, [])


def test_llama3_json_text_after_the_last_call_is_content() -> None:
    content, calls = LLAMA.extract('{"name": "a", "parameters": {}}; {"oops": 1} and more')
    assert calls_of(calls) == [("a", {})]
    assert content == '; {"oops": 1} and more'


def test_mistral_reads_the_array_form_and_the_args_form() -> None:
    array = (
        'Sure. [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    )
    content, calls = MISTRAL.extract(array)
    assert content == "Sure."
    assert calls_of(calls) == [("a", {"x": 1}), ("b", {})]
    args = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}'
    assert calls_of(MISTRAL.extract(args)[1]) == [("get_weather", {"city": "Paris"}), ("now", {})]


@pytest.mark.parametrize(
    "text",
    [
        "[TOOL_CALLS]",
        '[TOOL_CALLS][{"name": "a"}, {"name": 2}]',
        "[TOOL_CALLS]get weather[ARGS]{}",
        "[TOOL_CALLS]f[ARGS][1]",
        '[TOOL_CALLS][{"name": "a", "arguments": {}}',
    ],
)
def test_mistral_tag_that_opens_no_call_stays_content(text: str) -> None:
    assert MISTRAL.extract(text) == (text, [])


# ---- streaming ----


def test_a_tag_split_one_character_at_a_time_never_reaches_content() -> None:
    text = 'Hi <tool_call>{"name": "f", "arguments": {"q": "<b>"}}</tool_call> bye'
    stream = HERMES.stream()
    deltas = [stream.push(ch) for ch in text] + [stream.finish()]
    pieces = [delta.content for delta in deltas if delta.content]
    assert "".join(pieces) == "Hi  bye"
    assert all("<" not in piece for piece in pieces)
    assert streamed_calls(deltas) == [("f", '{"q": "<b>"}')]


def test_a_call_is_sent_whole_once_its_closing_tag_arrives() -> None:
    stream = HERMES.stream()
    assert stream.push('<tool_call>{"name": "f", "arguments": {"a": 1}}') == ParsedDelta("", ())
    delta = stream.push("</tool_call>")
    assert [(d.index, d.name, d.arguments) for d in delta.tool_calls] == [
        (0, "f", ""),
        (0, None, '{"a": 1}'),
    ]


def test_streamed_content_leaves_out_whitespace_around_calls() -> None:
    content, deltas = run_stream(
        "hermes", ["\n", '<tool_call>{"name": "f"}</tool_call>', "\n\n", "</tool"]
    )
    assert content == "</tool"
    assert all(delta.content.strip() == delta.content for delta in deltas)


def test_unknown_parser_names_the_option_and_the_choices() -> None:
    with pytest.raises(ValueError, match="--tool-call-parser='qwen'") as info:
        tool_parser("qwen")
    for name in ("hermes", "llama3_json", "mistral"):
        assert name in str(info.value)


def test_call_ids_are_call_and_24_hex_digits() -> None:
    ids = {new_call_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(len(i) == 29 and i.startswith("call_") and int(i[5:], 16) >= 0 for i in ids)


# ---- properties ----

NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
ARGUMENTS = st.dictionaries(st.text(max_size=6), VALUES, max_size=4)
CALLS = st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3)
CUTS = st.lists(st.integers(0, 400), max_size=12)


def hermes_text(pieces: Sequence[str], calls: Sequence[tuple[str, Any]], ascii_json: bool) -> str:
    blocks = [
        "<tool_call>\n"
        + json.dumps({"name": n, "arguments": a}, ensure_ascii=ascii_json)
        + "\n</tool_call>"
        for n, a in calls
    ]
    out = [pieces[0]]
    for block, piece in zip(blocks, pieces[1:], strict=False):
        out += [block, piece]
    return "".join(out)


def expected_calls(calls: Sequence[tuple[str, Any]]) -> list[tuple[str, str]]:
    return [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]


@settings(max_examples=60, deadline=None)
@given(
    calls=CALLS,
    pieces=st.lists(
        st.text(st.characters(blacklist_characters="<"), max_size=12), min_size=4, max_size=4
    ),
    ascii_json=st.booleans(),
    cuts=CUTS,
)
def test_hermes_any_split_gives_the_whole_outputs_calls_and_content(
    calls: list[tuple[str, Any]], pieces: list[str], ascii_json: bool, cuts: list[int]
) -> None:
    text = hermes_text(pieces, calls, ascii_json)
    whole_content, whole_calls = HERMES.extract(text)
    assert whole_content == ("".join(pieces[: len(calls) + 1]).strip() or None)
    assert [(c.name, c.arguments) for c in whole_calls] == expected_calls(calls)
    content, deltas = run_stream("hermes", split_at(text, cuts))
    assert content == (whole_content or "")
    assert streamed_calls(deltas) == expected_calls(calls)
    assert all("<" not in delta.content for delta in deltas)


@settings(max_examples=40, deadline=None)
@given(calls=CALLS, tag=st.booleans(), separator=st.sampled_from(["; ", ";", " ;\n"]), cuts=CUTS)
def test_llama3_json_any_split_gives_the_whole_outputs_calls(
    calls: list[tuple[str, Any]], tag: bool, separator: str, cuts: list[int]
) -> None:
    objects = [json.dumps({"name": n, "parameters": a}) for n, a in calls]
    text = ("<|python_tag|>" if tag else "") + separator.join(objects)
    content, deltas = run_stream("llama3_json", split_at(text, cuts))
    assert content == ""
    assert streamed_calls(deltas) == expected_calls(calls)
    assert [(c.name, c.arguments) for c in LLAMA.extract(text)[1]] == expected_calls(calls)


@settings(max_examples=40, deadline=None)
@given(calls=CALLS, lead=st.text(st.characters(blacklist_characters="["), max_size=10), cuts=CUTS)
def test_mistral_any_split_gives_the_whole_outputs_calls(
    calls: list[tuple[str, Any]], lead: str, cuts: list[int]
) -> None:
    array = json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)
    text = lead + "[TOOL_CALLS]" + array
    content, deltas = run_stream("mistral", split_at(text, cuts))
    assert content == lead.strip()
    assert streamed_calls(deltas) == expected_calls(calls)


# Pieces of every format's syntax, to build outputs that are mostly malformed.
SYNTAX = [
    "<tool_call>", "</tool_call>", "<tool", "_call>", "</", "<|python_tag|>", "[TOOL_CALLS]",
    "[ARGS]", "[", "]", "{", "}", '"name"', '"arguments"', '"parameters"', ": ", ", ", "; ",
    '"f"', '"x"', "1", "\\", '"', " ", "\n", "a", "é",
    '<tool_call>{"name": "f"}</tool_call>', '{"name": "f", "parameters": {}}',
    "[TOOL_CALLS]f[ARGS]{}", '[TOOL_CALLS][{"name": "f"}]',
]  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    parser=st.sampled_from(sorted(TOOL_PARSERS)),
    parts=st.lists(st.sampled_from(SYNTAX), max_size=30),
    cuts=CUTS,
)
def test_any_text_split_anywhere_parses_as_the_whole_and_never_raises(
    parser: str, parts: list[str], cuts: list[int]
) -> None:
    text = "".join(parts)
    whole_content, whole_calls = tool_parser(parser).extract(text)
    content, deltas = run_stream(parser, split_at(text, cuts))
    assert content == (whole_content or "")
    assert streamed_calls(deltas) == [(c.name, c.arguments) for c in whole_calls]
    for _, arguments in streamed_calls(deltas):
        assert isinstance(json.loads(arguments), dict)


# ---- prompts ----

WEATHER = ToolFunction(
    "get_weather",
    "Weather of a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    },
)
NOW = ToolFunction("now", None)


def test_tools_prompt_is_written_as_qwen25s_template_writes_it() -> None:
    prompt = render_tools_prompt([WEATHER, NOW])
    assert prompt.startswith(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    )
    lines = prompt.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(line) for line in lines] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather of a city",
                "parameters": WEATHER.parameters,
            },
        },
        {
            "type": "function",
            "function": {"name": "now", "parameters": {"type": "object", "properties": {}}},
        },
    ]
    assert prompt.endswith(
        "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def test_earlier_calls_written_in_hermes_form_parse_back() -> None:
    calls = [
        ToolCall("call_1", "get_weather", '{"city": "Zürich"}'),
        ToolCall("call_2", "now", "{}"),
    ]
    text = tool_call_text(calls)
    assert text.split("\n")[:3] == [
        "<tool_call>",
        '{"name": "get_weather", "arguments": {"city": "Zürich"}}',
        "</tool_call>",
    ]
    assert calls_of(HERMES.extract(text)[1]) == calls_of(calls)
    assert '"arguments": "not json"' in tool_call_text([ToolCall("c", "f", "not json")])


# ---- grammars ----

SMOLLM2_TOKENIZER = (
    Path(os.environ.get("HYBRIDSERVE_MODELS_DIR") or Path(__file__).resolve().parents[2] / "models")
    / "smollm2-hf"
    / "tokenizer.json"
)


def byte_tokenizer_json() -> str:
    """A tokenizer of single bytes and one end token: no model files needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<|endoftext|>"] = len(alphabet)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    return str(tokenizer.to_str())


@pytest.fixture(scope="module", params=["bytes", "smollm2"])
def matcher_for(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A function: grammar -> (accepts(text) -> bool), over a byte tokenizer and SmolLM2's."""
    llguidance = pytest.importorskip("llguidance")
    tokenizers = pytest.importorskip("tokenizers")
    if request.param == "smollm2":
        if not SMOLLM2_TOKENIZER.is_file():
            pytest.skip(f"{SMOLLM2_TOKENIZER} is absent (benchmarks/hf_checkpoint.py writes it)")
        tok = tokenizers.Tokenizer.from_file(str(SMOLLM2_TOKENIZER))
        lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=49152, eos_token=2)
    else:
        tok = tokenizers.Tokenizer.from_str(byte_tokenizer_json())
        lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=257, eos_token=256)

    def compile_grammar(grammar: str) -> Any:
        assert llguidance.LLMatcher.validate_grammar(grammar, lltok) == ""

        def accepts(text: str) -> bool:
            matcher = llguidance.LLMatcher(lltok, grammar)
            ids = tok.encode(text, add_special_tokens=False).ids
            return bool(matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting())

        return accepts

    yield compile_grammar


def call_texts(parser: str, calls: Sequence[tuple[str, dict[str, Any]]]) -> str:
    if parser == "hermes":
        return "\n".join(
            "<tool_call>\n"
            + json.dumps({"name": n, "arguments": a}, ensure_ascii=False)
            + "\n</tool_call>"
            for n, a in calls
        )
    if parser == "llama3_json":
        return "; ".join(
            json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls
        )
    array = [{"name": n, "arguments": a} for n, a in calls]
    return "[TOOL_CALLS]" + json.dumps(array, ensure_ascii=False)


GOOD = ("get_weather", {"city": "Zürich", "unit": "celsius"})


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_grammar_admits_a_call_that_parses_back(parser: str, matcher_for: Any) -> None:
    accepts = matcher_for(tool_parser(parser).grammar([WEATHER, NOW], parallel=False))
    text = call_texts(parser, [GOOD])
    assert accepts(text)
    assert calls_of(tool_parser(parser).extract(text)[1]) == [GOOD]
    assert accepts(call_texts(parser, [("now", {})]))


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_grammar_refuses_a_wrong_name_or_arguments(parser: str, matcher_for: Any) -> None:
    accepts = matcher_for(tool_parser(parser).grammar([WEATHER, NOW], parallel=True))
    assert not accepts(call_texts(parser, [("get_wether", {"city": "Paris"})]))
    assert not accepts(call_texts(parser, [("get_weather", {"city": 3})]))
    assert not accepts(call_texts(parser, [("get_weather", {"unit": "celsius"})]))
    assert not accepts(call_texts(parser, [("get_weather", {"city": "x", "unit": "kelvin"})]))
    assert not accepts("I will not call a tool.")


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_grammar_admits_several_calls_only_when_parallel(parser: str, matcher_for: Any) -> None:
    two = call_texts(parser, [GOOD, ("now", {})])
    assert matcher_for(tool_parser(parser).grammar([WEATHER, NOW], parallel=True))(two)
    assert not matcher_for(tool_parser(parser).grammar([WEATHER, NOW], parallel=False))(two)


def test_grammar_without_functions_is_refused() -> None:
    with pytest.raises(ValueError, match="tools"):
        HERMES.grammar([], parallel=False)


def test_hermes_reads_a_closing_tag_inside_an_argument_string_as_text() -> None:
    text = (
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "17}}</tool_call> more"}}'
        "\n</tool_call> after"
    )
    parser = tool_parser("hermes")
    content, calls = parser.extract(text)
    assert content == "after"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("calc", {"expression": "17}}</tool_call> more"})
    ]
    stream = parser.stream()
    deltas = [stream.push(ch) for ch in text] + [stream.finish()]
    streamed = "".join(d.tool_calls[1].arguments for d in deltas if len(d.tool_calls) > 1)
    assert json.loads(streamed) == {"expression": "17}}</tool_call> more"}
    broken = '<tool_call>{"name": "calc", "arguments": {</tool_call> tail'
    assert parser.extract(broken) == (broken, [])  # never closes: the first tag ends it
