"""Per-request rules on a step's sampling scores: `logit_bias`, `min_tokens` and grammars
(structured outputs).

They apply to the scores the sampler draws from (after penalties), never to the raw logits
that log-probabilities report. A row's rules, in order: the biases are added; a grammar
masks every token it does not allow to -inf; while the output is shorter than `min_tokens`,
stop tokens are masked too, unless the grammar allows nothing else (the grammar wins).

A complete output near its budget ends: when the grammar could end the output here (a whole
JSON value, a whole tool call) and fewer tokens remain under `max_tokens` than the output
already holds, only the stop tokens remain allowed. Another element (a further parallel
call, one more array item) would likely not fit, and a cut one would leave the output
invalid; an output that is not yet complete is never cut short this way.

With drafts (speculative decoding) the row that checks draft j is masked as the grammar stands
after drafts 0..j-1, so a draft the grammar refuses is never accepted; the matcher is rolled
back before the emitted tokens are committed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridserve.core.errors import ConfigError
from hybridserve.core.request import SamplingParams
from hybridserve.executor.grammar import GrammarMatcher, Grammars

logger = logging.getLogger(__name__)

_BITS = torch.arange(8, dtype=torch.uint8)


@dataclass(frozen=True, slots=True)
class RuleRows:
    """One request's rows in a step's sampling scores: `first` and `len(drafts) + 1` after it;
    `num_output` tokens were generated before the first row's."""

    req_id: str
    first: int
    drafts: Sequence[int]
    num_output: int
    params: SamplingParams


def _allowed(
    matcher: GrammarMatcher | None,
    params: SamplingParams,
    stops: list[int],
    num_output: int,
    vocab: int,
) -> torch.Tensor | None:
    """The [vocab] tokens a row with `num_output` tokens before it may sample (None: all)."""
    holding = num_output < params.min_tokens and bool(stops) and not params.ignore_eos
    if matcher is None and not holding:
        return None
    if matcher is None:
        allowed = torch.ones(vocab, dtype=torch.bool)
    else:
        allowed = allowed_tokens(matcher.allowed(), vocab)
        if stops and matcher.accepting and _budget_spent(params, num_output):
            ending = torch.zeros_like(allowed)
            ending[stops] = True
            if bool((allowed & ending).any()):
                allowed &= ending
    if holding:
        without_stops = allowed.clone()
        without_stops[stops] = False
        if bool(without_stops.any()):
            allowed = without_stops
    return allowed


def _budget_spent(params: SamplingParams, num_output: int) -> bool:
    """Fewer tokens remain under max_tokens than the output already holds."""
    return params.max_tokens - num_output < num_output


def has_rules(params: SamplingParams | None) -> bool:
    return params is not None and bool(
        params.structured is not None or params.min_tokens or params.logit_bias
    )


def allowed_tokens(bitmask: bytes, vocab_size: int) -> torch.Tensor:
    """A grammar's bitmask (bit t % 32 of little-endian word t // 32) as a [vocab_size] bool."""
    packed = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8)
    bits = (packed.unsqueeze(1) >> _BITS) & 1
    return bits.flatten()[:vocab_size].bool()


class Constraints:
    """The grammar matchers of the requests in flight, and the rules applied each step."""

    def __init__(self, grammars: Grammars | None) -> None:
        self.grammars = grammars
        self._matchers: dict[str, GrammarMatcher] = {}
        self._refused: dict[str, str] = {}  # requests whose grammar has no matcher, and why

    def start(self, req_id: str, params: SamplingParams) -> None:
        """Give a request with a grammar its matcher (once: a preempted request keeps it). A
        grammar that cannot be matched fails its request alone, at its first sample."""
        if params.structured is None or req_id in self._matchers or req_id in self._refused:
            return
        try:
            if self.grammars is None:
                raise ConfigError(
                    "structured",
                    params.structured.kind,
                    "this executor has no tokenizer grammars; give TorchExecutor `grammars` "
                    "(`hybridserve serve --executor torch` does)",
                )
            self._matchers[req_id] = self.grammars.matcher(params.structured)
        except ValueError as exc:  # ConfigError is one
            logger.warning("%s: its structured output cannot be enforced: %s", req_id, exc)
            self._refused[req_id] = str(exc)

    def forget(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)
        self._refused.pop(req_id, None)

    def apply(self, scores: torch.Tensor, requests: Sequence[RuleRows]) -> torch.Tensor:
        """`scores` [R, V] with the rules of `requests` applied (a copy; `scores` when no
        request has rules)."""
        if not requests:
            return scores
        out = scores.float().clone()
        for rows in requests:
            self._apply_one(out, rows)
        return out

    def _apply_one(self, out: torch.Tensor, rows: RuleRows) -> None:
        params, matcher = rows.params, self._matchers.get(rows.req_id)
        vocab = out.shape[-1]
        biased = [(t, b) for t, b in params.logit_bias if t < vocab]
        ids = torch.tensor([t for t, _ in biased], dtype=torch.long, device=out.device)
        bias = torch.tensor([b for _, b in biased], dtype=out.dtype).to(out.device)
        stops = [t for t in params.stop_token_ids if t < vocab]
        consumed = 0
        for j in range(len(rows.drafts) + 1):
            row = out[rows.first + j]
            if biased:
                row.index_add_(0, ids, bias)
            allowed = _allowed(matcher, params, stops, rows.num_output + j, vocab)
            if allowed is not None:
                row.masked_fill_(~allowed.to(out.device), float("-inf"))
            if matcher is not None and j < len(rows.drafts) and consumed == j:
                consumed += matcher.accept([rows.drafts[j]])
        if matcher is not None:
            matcher.rollback(consumed)

    def commit(self, req_id: str, emitted: Sequence[int]) -> bool:
        """Advance a request's grammar over the tokens it emitted; False (and a log line) when
        the grammar refuses one, which fails the request."""
        if req_id in self._refused:
            return False
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return True
        taken = matcher.accept(emitted)
        if taken == len(emitted):
            return True
        logger.warning(
            "%s: token %d is outside the request's grammar (%s)",
            req_id,
            emitted[taken],
            matcher.error or "refused",
        )
        return False
