"""OpenAI request models (pydantic, strict) and OpenAI-style errors.

Unknown fields are rejected (`extra="forbid"`), so a parameter this server does not implement
is a 400 naming it rather than silently ignored. vLLM's extensions `top_k`, `ignore_eos`,
`stop_token_ids`, `cache_salt` and `priority` are accepted. Types are strict (no "10" for 10,
no 0 for false), except that integer fields take integral floats (`1.0`), as OpenAI and vLLM
do.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from hybridserve.core.request import SEED_MAX, SEED_MIN

MAX_STOP_SEQUENCES = 16


def new_error_id() -> str:
    """An id that ties an error a client sees to the server log line that explains it."""
    return f"err-{secrets.token_hex(6)}"


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _off(value: bool) -> bool:
    if value:
        raise ValueError("is not supported; send false or leave it out")
    return value


# An integer, or a float with an integral value (1.0), as OpenAI and vLLM accept.
Integer = Annotated[int, BeforeValidator(_integral)]
# A feature this server does not implement: false or absent only (0 is not false).
Off = Annotated[bool, AfterValidator(_off)]


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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

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
    user: str | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    priority: Integer = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not supported; send 0 or leave it out")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"give at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
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
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    max_tokens: Annotated[Integer, Field(ge=1)] = 16
    echo: Off = False
    logprobs: None = None
    suffix: None = None
    best_of: Annotated[Integer, Field(ge=1, le=1)] | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessageModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
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
    logprobs: Off | None = None
    tools: None = None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the output limit, the field it came from): `max_completion_tokens` wins."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


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
        message = f"{param}: {message}"
    return ApiError(400, message, param=param, code=first["type"])


def _is_type_tag(part: object) -> bool:
    if not isinstance(part, str):
        return False
    return part in ("str", "int", "float", "bool", "none") or part.startswith(
        ("list[", "constrained-", "literal[", "function-")
    )
