"""Structured outputs below the server: grammars compiled once per tokenizer and checked, and
the executor's rules on sampling scores (grammar masks, `min_tokens`, `logit_bias`, drafts)."""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("llguidance")
tokenizers = pytest.importorskip("tokenizers")

from hybridserve.core.errors import RequestError  # noqa: E402
from hybridserve.core.request import SamplingParams, StructuredOutput  # noqa: E402
from hybridserve.executor import grammar as grammar_module  # noqa: E402
from hybridserve.executor.grammar import Grammars  # noqa: E402
from hybridserve.executor.torch.constraints import (  # noqa: E402
    Constraints,
    RuleRows,
    allowed_tokens,
)
from hybridserve.executor.torch.sampler import verify_batch  # noqa: E402
from tests.unit.test_tool_parsers import byte_tokenizer_json  # noqa: E402

VOCAB = 257
EOS = 256


@pytest.fixture(scope="module")
def tok() -> Any:
    return tokenizers.Tokenizer.from_str(byte_tokenizer_json())


@pytest.fixture
def grammars(tok: Any) -> Grammars:
    torch.set_num_threads(1)
    return Grammars(tok.to_str(), vocab_size=VOCAB, eos_token_ids=[EOS])


def ids(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def allowed_text(tok: Any, mask: torch.Tensor) -> set[str]:
    return {tok.id_to_token(i) if i != EOS else "<eos>" for i in mask.nonzero().flatten().tolist()}


def test_grammars_check_every_kind_and_name_what_is_wrong(grammars: Grammars) -> None:
    assert grammars.check(StructuredOutput("json", '{"type": "object"}')) is None
    assert grammars.check(StructuredOutput("regex", "yes|no")) is None
    assert grammars.check(StructuredOutput("lark", 'start: "a" | "b"')) is None
    assert "foo" in (grammars.check(StructuredOutput("json", '{"type": "foo"}')) or "")
    assert "unclosed group" in (grammars.check(StructuredOutput("regex", "a(b")) or "")
    assert "missing" in (grammars.check(StructuredOutput("lark", "start: missing")) or "")
    assert "not JSON" in (grammars.check(StructuredOutput("json", "{")) or "")
    with pytest.raises(RequestError, match=r"structured\.kind"):
        StructuredOutput("xml", "<a/>")


def test_a_grammar_compiles_once_and_the_cache_is_bounded(
    grammars: Grammars, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    yes_no = StructuredOutput("regex", "yes|no")
    first, second = grammars.matcher(yes_no), grammars.matcher(yes_no)
    assert grammars.num_cached == 1
    assert first.accept(ids(tok, "y")) == 1  # a matcher of its own: the other one has not moved
    assert first.allowed() != second.allowed()
    monkeypatch.setattr(grammar_module, "GRAMMAR_CACHE_SIZE", 3)
    for n in range(6):
        grammars.matcher(StructuredOutput("regex", f"a{{{n + 1}}}"))
    assert grammars.num_cached == 3


def test_regex_digits_are_ascii(grammars: Grammars, tok: Any) -> None:
    matcher = grammars.matcher(StructuredOutput("regex", r"\d"))
    allowed = allowed_text(tok, allowed_tokens(matcher.allowed(), VOCAB))
    assert allowed == set("0123456789")


def test_the_mask_allows_exactly_what_the_grammar_does_then_only_eos(
    grammars: Grammars, tok: Any
) -> None:
    matcher = grammars.matcher(StructuredOutput("regex", "ab|ac"))
    assert allowed_text(tok, allowed_tokens(matcher.allowed(), VOCAB)) == {"a"}
    assert matcher.accept(ids(tok, "ab")) == 2
    assert allowed_text(tok, allowed_tokens(matcher.allowed(), VOCAB)) == {"<eos>"}
    assert matcher.accept([EOS]) == 1 and matcher.done
    refused = grammars.matcher(StructuredOutput("regex", "ab"))
    assert refused.accept(ids(tok, "ax")) == 1  # the grammar stops at the refused token


def _rows(params: SamplingParams, *, drafts: tuple[int, ...] = (), num_output: int = 0) -> Any:
    return RuleRows("r", 0, drafts, num_output, params)


def test_min_tokens_masks_stops_unless_the_grammar_allows_nothing_else(
    grammars: Grammars, tok: Any
) -> None:
    scores = torch.zeros(1, VOCAB)
    free = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(EOS,))
    rules = Constraints(grammars)
    out = rules.apply(scores, [_rows(free, num_output=2)])
    assert out[0, EOS] == -math.inf and int(torch.isfinite(out[0]).sum()) == VOCAB - 1
    assert torch.isfinite(rules.apply(scores, [_rows(free, num_output=3)])[0]).all()
    done = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(EOS,),
                          structured=StructuredOutput("regex", "a"))  # fmt: skip
    rules.start("r", done)
    assert rules.commit("r", ids(tok, "a"))
    out = rules.apply(scores, [_rows(done, num_output=1)])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [EOS]  # the grammar wins


def test_logit_bias_is_added_before_sampling() -> None:
    scores = torch.zeros(1, VOCAB)
    params = SamplingParams(max_tokens=4, logit_bias=((7, 50.0), (9, -100.0)))
    out = Constraints(None).apply(scores, [_rows(params)])
    assert out[0, 7] == 50.0 and out[0, 9] == -100.0 and out[0, 8] == 0.0
    assert scores.abs().sum() == 0  # the raw scores are left alone


def test_draft_rows_see_the_grammar_after_earlier_drafts_and_it_rolls_back(
    grammars: Grammars, tok: Any
) -> None:
    params = SamplingParams(max_tokens=8, structured=StructuredOutput("regex", "abc"))
    rules = Constraints(grammars)
    rules.start("r", params)
    drafts = (ids(tok, "a")[0], ids(tok, "x")[0])
    out = rules.apply(torch.zeros(3, VOCAB), [_rows(params, drafts=drafts)])
    finite = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in out]
    assert finite[0] == set(ids(tok, "a")) and finite[1] == set(ids(tok, "b"))
    assert finite[2] == set(ids(tok, "b"))  # "x" was refused: the row stays after "a"
    assert rules.commit("r", ids(tok, "a"))  # the drafts were rolled back before this


def test_a_request_without_grammars_fails_alone(caplog: pytest.LogCaptureFixture) -> None:
    rules = Constraints(None)
    rules.start("r", SamplingParams(max_tokens=2, structured=StructuredOutput("regex", "a")))
    assert not rules.commit("r", (1,))
    assert rules.commit("other", (1,))
    assert "no tokenizer grammars" in caplog.text


def test_masked_rows_are_sampled_and_nan_rows_refused() -> None:
    logits = torch.full((3, 5), -math.inf)
    logits[0, 3] = 0.5
    logits[1, 1] = 2.0
    logits[1, 4] = 1.0
    logits[2, 2] = math.nan
    requests = [
        ((), None, 0),
        ((), SamplingParams(max_tokens=2, temperature=1.0, seed=1), 0),
        ((), None, 0),
    ]
    out = verify_batch(logits, requests)
    assert out[0] == (3,) and out[1][0] in (1, 4) and out[2] == ()


def test_a_complete_output_ends_once_the_rest_of_its_budget_is_smaller_than_it(
    grammars: Grammars, tok: Any
) -> None:
    params = SamplingParams(max_tokens=6, stop_token_ids=(EOS,),
                            structured=StructuredOutput("regex", "a+"))  # fmt: skip
    rules = Constraints(grammars)
    rules.start("r", params)
    scores = torch.zeros(1, VOCAB)
    assert rules.commit("r", ids(tok, "aa"))
    early = torch.isfinite(rules.apply(scores, [_rows(params, num_output=2)])[0])
    assert set(early.nonzero().flatten().tolist()) == {*ids(tok, "a"), EOS}  # 4 left >= 2
    assert rules.commit("r", ids(tok, "aa"))
    late = torch.isfinite(rules.apply(scores, [_rows(params, num_output=4)])[0])
    assert late.nonzero().flatten().tolist() == [EOS]  # 2 left < 4 written: it ends
    open_params = SamplingParams(max_tokens=6, stop_token_ids=(EOS,),
                                 structured=StructuredOutput("regex", "a{6}"))  # fmt: skip
    rules.start("s", open_params)
    assert rules.commit("s", ids(tok, "aaaa"))
    incomplete = RuleRows("s", 0, (), 4, open_params)
    row = torch.isfinite(rules.apply(scores, [incomplete])[0])
    assert row.nonzero().flatten().tolist() == ids(tok, "a")  # never cut short


def test_a_dcp_follower_gets_grammars_equal_to_rank_zeros(grammars: Grammars, tok: Any) -> None:
    from hybridserve.executor.torch.dcp import follower_options

    options = follower_options({"num_blocks": 8, "grammar_source": grammars.source})
    theirs = options.pop("grammars")
    assert options == {"num_blocks": 8}
    yes_no = StructuredOutput("regex", "yes|no")
    mine, other = grammars.matcher(yes_no), theirs.matcher(yes_no)
    assert mine.allowed() == other.allowed()
    assert follower_options({"num_blocks": 8}) == {"num_blocks": 8}
