"""OpenAI request models (pydantic, strict) and OpenAI-style errors.

Unknown fields are rejected (`extra="forbid"`), so a parameter this server does not implement
is a 400 naming it rather than silently ignored. vLLM's extensions `top_k`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `cache_salt` and `priority` are
implemented; vLLM's other sampling parameters are accepted at their neutral value (`min_p: 0`,
`skip_special_tokens: true`, ...) and refused otherwise. `null` means "left out" for every
field, as in vLLM. Types are strict (no "10" for 10, no 0 for false), except that integer
fields take integral floats (`1.0`), as OpenAI and vLLM do.
"""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)

from hybridserve.core.request import (
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    REPETITION_RANGE,
    SEED_MAX,
    SEED_MIN,
)

MAX_STOP_SEQUENCES = 16
MAX_USER_CHARS = 65_536


def new_error_id() -> str:
    """An id that ties an error a client sees to the server log line that explains it."""
    return f"err-{secrets.token_hex(6)}"


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _unsupported(value: Any) -> Any:
    raise ValueError("is not supported; leave it out or send null")


def _bool_only(value: Any) -> Any:
    # `Literal[False]` compares with ==, so 0 would pass as false: refuse non-booleans first.
    if not isinstance(value, bool):
        raise ValueError("give a JSON boolean")
    return value


# An integer, or a float with an integral value (1.0), as OpenAI and vLLM accept.
Integer = Annotated[int, BeforeValidator(_integral)]
# A boolean accepted at one value only (a parameter at its neutral setting): `false`/`true`,
# never 0/1.
OnlyFalse = Annotated[Literal[False], BeforeValidator(_bool_only)]
OnlyTrue = Annotated[Literal[True], BeforeValidator(_bool_only)]
# A feature this server does not implement: absent or null only.
Unsupported = Annotated[None, BeforeValidator(_unsupported)]


def neutral(shown: str) -> WrapValidator:
    """Metadata for a parameter accepted at its neutral value only (vLLM's `min_p: 0`, ...):
    any other value is refused with a message naming the accepted one, `shown`."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(
                f"{json.dumps(value)[:80]} is not supported; only {shown} (the default, which "
                "changes nothing) is accepted; leave it out"
            ) from None

    return WrapValidator(check)


def _token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_prompt(value: Any) -> Any:
    """A completion prompt is a non-empty string, a non-empty list of token ids, or a
    non-empty list of either (a batch: one choice per prompt)."""
    shapes = (
        "give a non-empty string, a non-empty list of token ids, or a non-empty list of "
        "strings or of token-id lists (one choice per prompt)"
    )

    def check_ids(ids: list[Any], where: str) -> None:
        if not all(_token_id(t) for t in ids):
            raise ValueError(f"{where}token ids must be integers; {shapes}")
        if min(ids) < 0:
            raise ValueError(f"{where}token ids must be >= 0")

    if isinstance(value, str):
        if not value:
            raise ValueError(f"the prompt is empty; {shapes}")
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(shapes)
    if _token_id(value[0]):
        check_ids(value, "")
        return value
    if all(isinstance(v, str) for v in value):
        empty = next((i for i, v in enumerate(value) if not v), None)
        if empty is not None:
            raise ValueError(f"prompt {empty} of the batch is empty")
        return value
    if all(isinstance(v, list) for v in value):
        for i, ids in enumerate(value):
            if not ids:
                raise ValueError(f"prompt {i} of the batch is empty")
            check_ids(ids, f"prompt {i} of the batch: ")
        return value
    raise ValueError(shapes)


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class _Body(BaseModel):
    """Strict, closed request models; `null` for any field means the field was left out, as
    vLLM reads it (`"temperature": null` is the default temperature)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: Annotated[OnlyFalse, neutral("false")] = False


class TextFormat(_Body):
    type: Literal["text"]


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _SamplingFields(_Body):
    model: str
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[Integer, Field(ge=-1)] = 0  # vLLM: -1 or 0 = off
    seed: Annotated[Integer, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[Integer, Field(ge=1)] = 1
    # The session id for tool-call pinning (OpenAI's end-user id); the engine keeps only a
    # fixed-size digest of it, scoped by `cache_salt`.
    user: Annotated[str, Field(max_length=MAX_USER_CHARS)] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    priority: Integer = 0
    # Penalties as vLLM defines them (see SamplingParams); 0, 0 and 1 are off.
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(allow_inf_nan=False)] = 1.0
    # vLLM's other sampling parameters: accepted at their neutral (default) value only.
    use_beam_search: Annotated[OnlyFalse, neutral("false")] = False
    min_p: Annotated[float, Field(ge=0.0, le=0.0), neutral("0")] = 0.0
    length_penalty: Annotated[float, Field(ge=1.0, le=1.0), neutral("1")] = 1.0
    include_stop_str_in_output: Annotated[OnlyFalse, neutral("false")] = False
    min_tokens: Annotated[Integer, Field(ge=0, le=0), neutral("0")] = 0
    skip_special_tokens: Annotated[OnlyTrue, neutral("true")] = True
    spaces_between_special_tokens: Annotated[OnlyTrue, neutral("true")] = True
    truncation_side: Literal["left", "right"] | None = None  # no effect without truncation
    allowed_token_ids: Unsupported = None
    bad_words: Annotated[list[str], Field(max_length=0), neutral("[]")] = []
    logit_bias: Annotated[dict[str, float], Field(max_length=0), neutral("{}")] = {}
    truncate_prompt_tokens: Unsupported = None
    prompt_logprobs: Unsupported = None
    logprob_token_ids: Unsupported = None
    watermarking: Annotated[OnlyFalse, neutral("false")] = False
    response_format: TextFormat | None = None
    structured_outputs: Unsupported = None
    guided_json: Unsupported = None
    guided_regex: Unsupported = None
    guided_choice: Unsupported = None
    guided_grammar: Unsupported = None
    guided_decoding_backend: Unsupported = None
    guided_whitespace_pattern: Unsupported = None
    return_tokens_as_token_ids: Annotated[OnlyFalse, neutral("false")] = False
    return_token_ids: Annotated[OnlyFalse, neutral("false")] = False
    logits_processors: Unsupported = None
    vllm_xargs: Unsupported = None
    kv_transfer_params: Unsupported = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"give at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_in_range(cls, value: float) -> float:
        if not MIN_REPETITION_PENALTY <= value <= MAX_REPETITION_PENALTY:
            raise ValueError(f"{value!r} is outside the accepted range; {REPETITION_RANGE}")
        return value

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("set it only with stream: true")
        return value

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_SamplingFields):
    # One prompt (text or token ids) or a batch of them: one choice each, in order.
    prompt: Annotated[str | list[int] | list[str] | list[list[int]], BeforeValidator(_check_prompt)]
    # 0 only with echo: the prompt is scored, nothing is generated.
    max_tokens: Annotated[Integer, Field(ge=0)] = 16
    echo: bool = False
    logprobs: Annotated[Integer, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: Unsupported = None
    best_of: Annotated[Integer, Field(ge=1, le=1)] | None = None
    add_special_tokens: Annotated[OnlyTrue, neutral("true")] = True

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts of this request, one per choice."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [prompt]
        return prompt


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessageModel(_Body):
    # "developer" is OpenAI's newer name for system instructions.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessageModel], Field(min_length=1)]
    max_tokens: Annotated[Integer, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[Integer, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[Integer, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Any], Field(max_length=0), neutral("[]")] = []
    # Without tools, "auto" calls none either.
    tool_choice: Annotated[Literal["none", "auto"], neutral('"none" or "auto"')] = "none"
    parallel_tool_calls: bool = True  # no effect without tools
    # vLLM's chat extras, at their neutral values only.
    echo: Annotated[OnlyFalse, neutral("false")] = False
    add_generation_prompt: Annotated[OnlyTrue, neutral("true")] = True
    continue_final_message: Annotated[OnlyFalse, neutral("false")] = False
    add_special_tokens: Annotated[OnlyFalse, neutral("false")] = False
    documents: Unsupported = None
    chat_template: Unsupported = None
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=0), neutral("{}")] = {}
    mm_processor_kwargs: Unsupported = None
    reasoning_effort: Unsupported = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs", False):
            raise ValueError("set it only with logprobs: true")
        return value

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the output limit, the field it came from): `max_completion_tokens` wins."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def num_logprobs(self) -> int | None:
        """Alternatives per generated token to report (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None


def validation_error(exc: ValidationError) -> ApiError:
    """The first pydantic error as a 400 naming its field (`messages.0.role`)."""
    first = exc.errors()[0]
    # Union members add their type to the location ("prompt.str"); keep the field path.
    parts = [str(p) for p in first["loc"] if not _is_type_tag(p)]
    param = ".".join(parts) or None
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = f"unsupported parameter {param!r}"
    elif first["type"] == "missing":
        message = f"missing required field {param!r}"
    else:
        message = f"{param}: {message.removeprefix('Value error, ')}"
    return ApiError(400, message, param=param, code=first["type"])


def _is_type_tag(part: object) -> bool:
    if not isinstance(part, str):
        return False
    return part in ("str", "int", "float", "bool", "none") or part.startswith(
        ("list[", "constrained-", "literal[", "function-")
    )
