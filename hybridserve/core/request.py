"""Requests: sampling parameters, the lifecycle state machine, and per-request token state."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from hybridserve.core.errors import IllegalTransition, RequestError


class RequestStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"


# The only legal moves. Statuses are never compared by order.
_ALLOWED: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset({RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED}),
    RequestStatus.RUNNING: frozenset(
        {
            RequestStatus.PREEMPTED,
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        }
    ),
    RequestStatus.PREEMPTED: frozenset({RequestStatus.RUNNING, RequestStatus.FINISHED_ABORTED}),
}


# Temperatures below this sample greedily, as vLLM's `_SAMPLING_EPS` does
# (vllm/v1/sample/sampler.py): float32 logits divided by less overflow to inf and the softmax
# turns to NaN. At the floor, logits up to 3e33 in magnitude stay finite.
MIN_TEMPERATURE = 1e-5
# The sampler compares top_p with float32 cumulative probabilities, where anything below
# float32's smallest normal number rounds to 0 and would mask every token. The top token is
# always kept and its probability is at least 1/vocab, far above this floor, so raising top_p
# to it leaves the distribution unchanged.
MIN_TOP_P = 2.0**-126
# Repetition divides a seen token's positive logit by the penalty and multiplies a negative one
# by it, so a penalty near 0 (5e-324 is 0 in float32) or a huge one overflows float32 logits to
# inf and the softmax to NaN. vLLM refuses only non-finite values and values <= 0
# (vllm/sampling_params.py), SGLang anything outside (0, 2] (sglang/srt/sampling/
# sampling_params.py). This range is symmetric in log space, keeps every logit below 3.4e36 in
# magnitude finite, and holds SGLang's range from 0.01 and vLLM's above 2 up to 100.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
REPETITION_RANGE = (
    f"use a value in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 = off); "
    "values outside it overflow float32 logits"
)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # seeds are 64-bit signed integers (as vLLM's)
# The most top alternatives a request may ask for per token (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


# OpenAI's range for `logit_bias` values.
MAX_LOGIT_BIAS = 100.0
STRUCTURED_KINDS = ("json", "regex", "lark")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """Output constrained by a grammar: `kind` "json" (`spec` is a JSON schema, as text),
    "regex" (the whole output matches `spec`) or "lark" (a Lark grammar in llguidance's
    dialect). An executor with a tokenizer enforces it token by token; the core only carries
    it."""

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise RequestError(
                "structured.kind", self.kind, f"use one of {', '.join(STRUCTURED_KINDS)}"
            )
        if not isinstance(self.spec, str) or not self.spec:
            raise RequestError("structured.spec", self.spec, "give a non-empty grammar text")


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How to sample one request's output. Validated at construction."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Penalties as vLLM defines them (vllm/model_executor/layers/utils.py `apply_penalties`):
    # repetition divides a positive logit (multiplies a negative one) of every token seen in
    # the prompt or the output; frequency subtracts `penalty * count in the output`; presence
    # subtracts `penalty` once per token present in the output. 1.0 / 0.0 / 0.0 = off.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Log-probabilities to return: None = none; N = each generated token's and its N most
    # likely alternatives'; `prompt_logprobs` the same for every prompt token but the first.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # The output follows this grammar (None: free text).
    structured: StructuredOutput | None = None
    # Stop tokens cannot end the output before this many tokens (vLLM's `min_tokens`); a
    # grammar that allows nothing else wins.
    min_tokens: int = 0
    # (token id, bias) pairs added to the logits before sampling (OpenAI's `logit_bias`).
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise RequestError("max_tokens", self.max_tokens, "use an integer >= 1")
        if self.max_tokens < 1:
            raise RequestError("max_tokens", self.max_tokens, "use an integer >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError("temperature", self.temperature, "use a value in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError("top_p", self.top_p, "use a value in (0, 1]")
        if self.top_k < 0:
            raise RequestError("top_k", self.top_k, "use 0 (off) or a positive integer")
        if any(t < 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids", self.stop_token_ids, "token ids are >= 0")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise RequestError("seed", self.seed, "use a 64-bit signed integer")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise RequestError("repetition_penalty", self.repetition_penalty, REPETITION_RANGE)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise RequestError(name, getattr(self, name), "use a value in [-2, 2] (0 = off)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise RequestError(name, value, f"use 0 to {MAX_LOGPROBS}, or None for none")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(
                "min_tokens", self.min_tokens, f"use 0 to max_tokens ({self.max_tokens})"
            )
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise RequestError("logit_bias", token_id, "token ids are >= 0")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise RequestError(
                    "logit_bias", bias, f"use a bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
                )

    def numerically_safe(self) -> SamplingParams:
        """These settings as a float32 sampler must apply them: greedy below MIN_TEMPERATURE,
        top_p raised to MIN_TOP_P. Both give the same distribution as the exact arithmetic
        (up to ties at a temperature near 0) without overflowing or masking every token."""
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            return replace(self, temperature=0.0)
        if self.top_p < MIN_TOP_P:
            return replace(self, top_p=MIN_TOP_P)
        return self


SESSION_KEY_BYTES = 16


def session_key(cache_salt: str | None, session_id: str) -> str:
    """The session's key within its tenant (its cache salt): a 32-character digest."""
    digest = hashlib.blake2b(digest_size=SESSION_KEY_BYTES)
    if cache_salt is not None:
        digest.update(b"salt\x00" + cache_salt.encode("utf-8", "surrogatepass") + b"\x00")
    digest.update(b"session\x00" + session_id.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


@dataclass(kw_only=True, slots=True, eq=False)
class Request:
    """One generation request. Only the scheduler mutates it.

    `num_computed_tokens` counts tokens whose KV (or state) is in the cache; the scheduling model
    has no prefill/decode phase: computed tokens catch up with `num_tokens` (vLLM v1).
    """

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    # The session (agent job, conversation) a request belongs to: turns of one session share a
    # prefix and return after a tool call. None: a standalone request.
    session_id: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    # Chained block hashes of the full blocks of all_token_ids (maintained by the scheduler).
    block_hashes: list[bytes] = field(default_factory=list)
    # Shared-prefix junction found at the last admission: a prefix whose states are missing;
    # prefill chunks stop there so that the state gets materialised (0 = none).
    prefix_junction: int = 0
    # Draft tokens proposed for the next step (speculative decoding); not yet verified.
    draft_token_ids: list[int] = field(default_factory=list)
    # Leading prompt tokens whose KV (and state) arrived from another engine (a prefill/decode
    # handoff, vLLM's KV connector): admission marks them computed at once, without scheduling
    # them. Consumed at the first admission; a preempted request recomputes them. 0 = none.
    num_external_computed_tokens: int = 0
    token_ids: list[int] = field(init=False)  # prompt + output, grown in place
    num_prompt_tokens: int = field(init=False)
    # What pins, tool-gap statistics and program order key the session by: a fixed-size
    # digest of (cache_salt, session_id), so two tenants' sessions of one name never meet and
    # a long id costs no more memory than a short one once the request is gone.
    session_key: str | None = field(init=False)

    def __post_init__(self) -> None:
        if not self.req_id:
            raise RequestError("req_id", self.req_id, "use a non-empty id")
        if len(self.prompt_token_ids) == 0:
            raise RequestError("prompt_token_ids", (), "send at least one prompt token")
        if min(self.prompt_token_ids) < 0:
            raise RequestError("prompt_token_ids", "<negative id>", "token ids are >= 0")
        if self.session_id is not None and (
            not isinstance(self.session_id, str) or not self.session_id
        ):
            raise RequestError("session_id", self.session_id, "use a non-empty string or omit it")
        external = self.num_external_computed_tokens
        if (
            isinstance(external, bool)
            or not isinstance(external, int)
            or not 0 <= external < len(self.prompt_token_ids)
        ):
            raise RequestError(
                "num_external_computed_tokens",
                external,
                f"use 0 to {len(self.prompt_token_ids) - 1}: the last prompt token is computed "
                "here, for its logits",
            )
        self.token_ids = [*self.prompt_token_ids, *self.output_token_ids]
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.session_key = (
            None if self.session_id is None else session_key(self.cache_salt, self.session_id)
        )

    def append_output_tokens(self, token_ids: Sequence[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.token_ids.extend(token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def prefill_end(self) -> int:
        """Where this request's prefill ends: the prompt's end or, for a request resumed after a
        preemption, all its tokens but the last (the recompute; the last is the next decode's
        input). A chunk starting before this position is a prefill chunk, one at it a decode."""
        return max(self.num_prompt_tokens, len(self.token_ids) - 1)

    @property
    def num_tokens_with_drafts(self) -> int:
        return len(self.token_ids) + len(self.draft_token_ids)

    @property
    def all_token_ids(self) -> Sequence[int]:
        return self.token_ids

    def transition(self, to: RequestStatus) -> None:
        """Move to `to`. Raises IllegalTransition for a move the state machine does not allow."""
        if to not in _ALLOWED.get(self.status, frozenset()):
            raise IllegalTransition(self.req_id, self.status.value, to.value)
        self.status = to
        if to is RequestStatus.FINISHED_STOPPED:
            self.finish_reason = FinishReason.STOP
        elif to is RequestStatus.FINISHED_LENGTH:
            self.finish_reason = FinishReason.LENGTH
        elif to is RequestStatus.FINISHED_ABORTED:
            self.finish_reason = FinishReason.ABORT


def keep_sampled(
    sampling: SamplingParams, num_output_tokens: int, sampled: tuple[int, ...]
) -> tuple[tuple[int, ...] | list[int], RequestStatus | None]:
    """The tokens of `sampled` a request with `num_output_tokens` outputs keeps, in order, and
    the status it finishes with (None: it keeps running): a stop token is kept and ends it, as
    does reaching max_tokens; tokens after either are dropped. The scheduler's rule; an
    executor reads it to commit recurrent states only for tokens the request keeps."""
    stop_ids = () if sampling.ignore_eos else sampling.stop_token_ids
    room = sampling.max_tokens - num_output_tokens
    if len(sampled) == 1 and not stop_ids and room > 1:
        return sampled, None  # the common decode: nothing to check
    kept: list[int] = []
    for token in sampled:
        kept.append(token)
        if token in stop_ids:
            return kept, RequestStatus.FINISHED_STOPPED
        if len(kept) >= room:
            return kept, RequestStatus.FINISHED_LENGTH
    return kept, None
