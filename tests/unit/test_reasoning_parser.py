"""The reasoning parsers: `<think>...</think>` split off as reasoning, qwen3 only after an opening
tag, deepseek_r1 up to the closing tag with or without one; any split of an output into streamed
fragments gives the whole output's answer, and no delta holds part of a tag."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.server.reasoning import REASONING_PARSERS, reasoning_parser

QWEN3 = reasoning_parser("qwen3")
R1 = reasoning_parser("deepseek_r1")


def run_stream(name: str, fragments: Sequence[str]) -> list[tuple[str, str]]:
    stream = reasoning_parser(name).stream()
    return [stream.push(fragment) for fragment in fragments] + [stream.finish()]


def joined(deltas: Sequence[tuple[str, str]]) -> tuple[str | None, str | None]:
    reasoning = "".join(r for r, _ in deltas)
    content = "".join(c for _, c in deltas)
    return reasoning or None, content or None


def split_at(text: str, cuts: Sequence[int]) -> list[str]:
    edges = [0, *sorted({min(cut, len(text)) for cut in cuts}), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(edges)]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_think_block_is_reasoning_and_the_rest_content_as_written(name: str) -> None:
    text = "<think>\nPlan.\n</think>\n\nAnswer."
    assert reasoning_parser(name).split(text) == ("\nPlan.\n", "\n\nAnswer.")


def test_qwen3_needs_the_opening_tag_for_any_reasoning() -> None:
    assert QWEN3.split("Plan.</think>Answer.") == (None, "Plan.</think>Answer.")
    assert QWEN3.split("Answer.") == (None, "Answer.")
    assert QWEN3.split("Answer <think>x</think>") == (None, "Answer <think>x</think>")


def test_deepseek_r1_reads_reasoning_before_the_closing_tag_without_an_opening_one() -> None:
    assert R1.split("Plan.</think>Answer.") == ("Plan.", "Answer.")
    assert R1.split("\n<think>Plan.</think>") == ("Plan.", None)


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_an_output_cut_inside_reasoning_is_all_reasoning(name: str) -> None:
    assert reasoning_parser(name).split("<think>Step one, step tw") == ("Step one, step tw", None)
    assert reasoning_parser(name).split("<think>Step one</thi") == ("Step one</thi", None)


def test_deepseek_r1_output_without_tags_is_reasoning() -> None:
    assert R1.split("All of it.") == ("All of it.", None)


def test_empty_output_has_neither() -> None:
    assert QWEN3.split("") == (None, None)
    assert R1.split("") == (None, None)


def test_a_closing_tag_split_one_character_at_a_time_reaches_neither_side() -> None:
    deltas = run_stream("qwen3", list("<think>ab</think>cd"))
    assert joined(deltas) == ("ab", "cd")
    assert all("<" not in r and "<" not in c for r, c in deltas)
    assert deltas[len("<think>a")] == ("b", "")


def test_whitespace_before_the_opening_tag_waits_for_the_tag() -> None:
    stream = QWEN3.stream()
    assert stream.push("\n ") == ("", "")
    assert stream.push("<thi") == ("", "")
    assert stream.push("nk>x") == ("x", "")


def test_unknown_parser_names_the_option_and_the_choices() -> None:
    with pytest.raises(ValueError, match="--reasoning-parser='r1'") as info:
        reasoning_parser("r1")
    assert "deepseek_r1" in str(info.value) and "qwen3" in str(info.value)


TEXT = st.text(st.characters(blacklist_characters="<"), max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(REASONING_PARSERS)),
    lead=st.sampled_from(["", " ", "\n", "<think>", "\n<think>"]),
    reasoning=TEXT,
    close=st.booleans(),
    content=TEXT,
    cuts=st.lists(st.integers(0, 60), max_size=10),
)
def test_any_split_gives_the_whole_outputs_split_and_no_tag_piece(
    name: str, lead: str, reasoning: str, close: bool, content: str, cuts: list[int]
) -> None:
    text = lead + reasoning + ("</think>" + content if close else "")
    whole = reasoning_parser(name).split(text)
    deltas = run_stream(name, split_at(text, cuts))
    assert joined(deltas) == whole
    opened = "<think>" in lead
    if opened or name == "deepseek_r1":
        assert all("<" not in r and "<" not in c for r, c in deltas)
        prefix = "" if opened else lead
        expected_content = content if close else ""
        assert whole == ((prefix + reasoning) or None, expected_content or None)
    else:
        assert whole == (None, text or None)


# Pieces of the tags, to build outputs with stray and broken tags.
PIECES = ["<think>", "</think>", "<thi", "nk>", "</", "<", ">", "a", " ", "\n", "é"]


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(sorted(REASONING_PARSERS)),
    parts=st.lists(st.sampled_from(PIECES), max_size=20),
    cuts=st.lists(st.integers(0, 80), max_size=10),
)
def test_any_text_split_anywhere_splits_as_the_whole(
    name: str, parts: list[str], cuts: list[int]
) -> None:
    text = "".join(parts)
    deltas = run_stream(name, split_at(text, cuts))
    assert joined(deltas) == reasoning_parser(name).split(text)
    reasoning, content = joined(deltas)
    assert (reasoning or "") + (content or "") in {
        text,  # qwen3 without an opening tag
        text.lstrip().removeprefix("<think>").replace("</think>", "", 1),
        text.replace("</think>", "", 1),  # deepseek_r1 without an opening tag
    }
