r"""Structured outputs: a request's grammar (JSON schema, regex, Lark) compiled for one
tokenizer with llguidance, checked before the request is queued, and matched token by token.

`Grammars` belongs to a model's tokenizer. `check` answers whether a grammar compiles (the
server refuses one that does not with a 400 naming the field); `matcher` gives a request its
own `GrammarMatcher`, copied from a compiled prototype kept in a bounded cache (keyed by the
grammar's kind and text), so the thousandth request with one schema compiles nothing.

A matcher's `allowed()` is the bitmask of tokens that keep the output inside the grammar (bit
`t % 32` of word `t // 32`); once the grammar is complete it allows only the end-of-sequence
tokens, so the output ends there. JSON is generated compactly (no free whitespace between
tokens of the JSON text), which keeps a small model from spending its tokens on blanks. In
a regex, `\d` is an ASCII digit (`[0-9]`), as JSON Schema patterns read it.

llguidance is imported only when a `Grammars` is built.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from hybridserve.core.request import StructuredOutput

# Compiled grammars kept per tokenizer (each a few kB to a few MB for large schemas).
GRAMMAR_CACHE_SIZE = 256
# JSON compiled without free whitespace (llguidance's `whitespace_flexible`).
_JSON_OPTIONS: Any = {"whitespace_flexible": False}


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, eos_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._eos = eos_token_ids

    def allowed(self) -> bytes:
        """The bitmask (little-endian 32-bit words) of tokens allowed next."""
        return bytes(self._matcher.compute_bitmask())

    def accept(self, token_ids: Sequence[int]) -> int:
        """Consume the longest prefix of `token_ids` the grammar allows; how many it took. An
        end-of-sequence token ends a complete output (the grammar allows it only then)."""
        taken = int(self._matcher.try_consume_tokens(list(token_ids)))
        if (
            taken < len(token_ids)
            and token_ids[taken] in self._eos
            and self._matcher.is_accepting()
            and self._matcher.consume_token(token_ids[taken])
        ):
            taken += 1
        return taken

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a grammar past llguidance's limits), or None."""
        return str(self._matcher.get_error()) if self._matcher.is_error() else None

    @property
    def accepting(self) -> bool:
        """The output so far is complete (it may end here, or go on)."""
        return bool(self._matcher.is_accepting())

    @property
    def done(self) -> bool:
        """The output is complete (only end-of-sequence remains)."""
        return bool(self._matcher.is_stopped())


class Grammars:
    """The grammars of one tokenizer: compiled once each, checked, and matched per request.

    `tokenizer_json`: the tokenizer as `tokenizers.Tokenizer.to_str()` writes it;
    `vocab_size`: the model's logits width (at least the tokenizer's vocabulary);
    `eos_token_ids`: the tokens that end a complete output."""

    def __init__(
        self, tokenizer_json: str, *, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        import llguidance

        self._llg = llguidance
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        # What builds an equal Grammars in another process (a DCP rank samples as rank 0).
        self.source = (tokenizer_json, vocab_size, self.eos_token_ids)
        self._tokenizer: Any = None
        self.unusable: str | None = None  # why this tokenizer cannot constrain outputs
        try:
            self._tokenizer = llguidance.LLTokenizer(
                tokenizer_json, n_vocab=vocab_size, eos_token=list(self.eos_token_ids)
            )
        except ValueError as exc:  # a tokenizer llguidance cannot read (no decoder, ...)
            self.unusable = (
                f"this model's tokenizer cannot drive constrained decoding ({exc}); structured "
                "outputs need a byte-level BPE or sentencepiece tokenizer"
            )
        self._prototypes: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()  # the server checks while the engine thread matches

    def check(self, structured: StructuredOutput) -> str | None:
        """Why `structured` cannot constrain an output (llguidance's message), or None when
        it compiles."""
        try:
            self._prototype(structured)
        except ValueError as exc:
            return str(exc)
        return None

    def matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for one request. Raises ValueError for a grammar `check` refuses."""
        return GrammarMatcher(
            self._prototype(structured).deep_copy(), frozenset(self.eos_token_ids)
        )

    def _prototype(self, structured: StructuredOutput) -> Any:
        if self.unusable is not None:
            raise ValueError(self.unusable)
        with self._lock:
            cached = self._prototypes.get(structured)
            if cached is not None:
                self._prototypes.move_to_end(structured)
                return cached
        grammar = self._grammar(structured)
        matcher_type = self._llg.LLMatcher
        error = matcher_type.validate_grammar(grammar, self._tokenizer)
        if error:
            raise ValueError(_one_line(error))
        prototype = matcher_type(self._tokenizer, grammar, log_level=0)
        if prototype.is_error():
            raise ValueError(_one_line(prototype.get_error()))
        with self._lock:
            self._prototypes[structured] = prototype
            while len(self._prototypes) > GRAMMAR_CACHE_SIZE:
                self._prototypes.popitem(last=False)
        return prototype

    def _grammar(self, structured: StructuredOutput) -> str:
        matcher_type = self._llg.LLMatcher
        if structured.kind == "json":
            try:
                schema = json.loads(structured.spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema is a JSON object")
            return str(matcher_type.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS))
        if structured.kind == "regex":
            # `\d` is an ASCII digit, as JSON Schema patterns read it (not any Unicode digit,
            # which a small model may pick among the digits a mask leaves it).
            ascii_digits = self._llg.regex_to_lark(structured.spec, "d")
            return str(matcher_type.grammar_from_regex(ascii_digits))
        return str(matcher_type.grammar_from_lark(structured.spec))

    @property
    def num_cached(self) -> int:
        return len(self._prototypes)


def _one_line(message: str) -> str:
    """llguidance's error on one line, without its excerpt of the generated grammar."""
    lines = [line.strip() for line in str(message).splitlines()]
    kept = [line for line in lines if line and not line[0].isdigit() and line != "^"]
    text = " ".join(kept)[:400]
    return text or "the grammar does not compile"
