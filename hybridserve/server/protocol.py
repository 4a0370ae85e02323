"""OpenAI request models (pydantic, strict) and OpenAI-style errors.

Fields no OpenAI or vLLM request defines (`store`, `metadata`, a client's own extras) are
ignored and logged with a warning, as vLLM does, so clients that send them keep working;
`ignored_fields` lists them. A parameter OpenAI or vLLM defines but this server does not
implement is a 400 naming it rather than silently ignored. vLLM's extensions `top_k`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `min_tokens`, `cache_salt`, `priority`
and structured outputs (`structured_outputs`, `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`) are implemented; vLLM's other sampling parameters are accepted at their
neutral value (`min_p: 0`, `skip_special_tokens: true`, ...) and refused otherwise. `null`
means "left out" for every field, as in vLLM. Types are strict (no "10" for 10, no 0 for
false), except that integer fields take integral floats (`1.0`), as OpenAI and vLLM do.
"""

from __future__ import annotations

import json
import re
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
    StructuredOutput,
)

MAX_STOP_SEQUENCES = 16
MAX_USER_CHARS = 65_536
MAX_CHOICES = 16  # `n`: choices per prompt
MAX_TOOLS = 128
ANY_JSON_OBJECT = '{"type": "object"}'


def _structured(kind: str, value: Any, field: str) -> StructuredOutput:
    """One structured-output field as the grammar the executor enforces."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ApiError(
                    400, f"{field}: the schema is not JSON ({exc})", param=field
                ) from None
        if not isinstance(value, dict):
            raise ApiError(400, f"{field}: a JSON schema is a JSON object", param=field)
        return StructuredOutput("json", json.dumps(value))
    if kind == "regex":
        return StructuredOutput("regex", value)
    if kind == "choice":
        if not all(isinstance(c, str) and c for c in value):
            raise ApiError(400, f"{field}: give non-empty strings", param=field)
        literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(value))
        return StructuredOutput("lark", f"start: {literals}")
    return StructuredOutput("lark", value)


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
    """Strict request models; `null` for any field means the field was left out, as vLLM
    reads it (`"temperature": null` is the default temperature). Unknown fields are kept
    aside (`model_extra`) and reported by `ignored_fields`."""

    model_config = ConfigDict(extra="allow", strict=True)

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


class JsonObjectFormat(_Body):
    type: Literal["json_object"]


class JsonSchema(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    # `schema` is a BaseModel attribute: the field keeps its JSON name through an alias.
    schema_: Annotated[dict[str, Any], Field(alias="schema")] = {}
    strict: bool | None = None


class JsonSchemaFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


class StructuredOutputsParams(_Body):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    regex: Annotated[str, Field(min_length=1)] | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: Annotated[str, Field(min_length=1)] | None = None
    json_object: bool | None = None


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
    min_tokens: Annotated[Integer, Field(ge=0)] = 0
    skip_special_tokens: Annotated[OnlyTrue, neutral("true")] = True
    spaces_between_special_tokens: Annotated[OnlyTrue, neutral("true")] = True
    truncation_side: Literal["left", "right"] | None = None  # no effect without truncation
    allowed_token_ids: Unsupported = None
    bad_words: Annotated[list[str], Field(max_length=0), neutral("[]")] = []
    # Token id (as a string, as OpenAI sends it) -> bias in [-100, 100].
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] = {}
    truncate_prompt_tokens: Unsupported = None
    prompt_logprobs: Unsupported = None
    logprob_token_ids: Unsupported = None
    watermarking: Annotated[OnlyFalse, neutral("false")] = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Annotated[str, Field(min_length=1)] | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: Annotated[str, Field(min_length=1)] | None = None
    # One backend serves structured outputs (llguidance); vLLM's names for it are accepted.
    guided_decoding_backend: Literal["auto", "guidance", "llguidance"] | None = None
    guided_whitespace_pattern: Unsupported = None
    return_tokens_as_token_ids: Annotated[OnlyFalse, neutral("false")] = False
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
    def _choices_bounded(cls, value: int) -> int:
        if value > MAX_CHOICES:
            raise ValueError(f"give at most {MAX_CHOICES} choices")
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

    def structured_fields(self) -> list[tuple[str, StructuredOutput]]:
        """The structured-output constraints the request gives, each with the field it came
        from (a valid request gives at most one)."""
        out: list[tuple[str, StructuredOutput]] = []
        fmt = self.response_format
        if isinstance(fmt, JsonObjectFormat):
            out.append(("response_format", StructuredOutput("json", ANY_JSON_OBJECT)))
        elif isinstance(fmt, JsonSchemaFormat):
            schema = json.dumps(fmt.json_schema.schema_ or {"type": "object"})
            out.append(("response_format.json_schema.schema", StructuredOutput("json", schema)))
        so = self.structured_outputs
        legacy = (self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar)
        given = (so.json_, so.regex, so.choice, so.grammar) if so else (None,) * 4
        for prefix, values in (("structured_outputs.", given), ("guided_", legacy)):
            for name, value in zip(("json", "regex", "choice", "grammar"), values, strict=True):
                if value is not None:
                    out.append((prefix + name, _structured(name, value, prefix + name)))
        if so is not None and so.json_object:
            out.append(
                ("structured_outputs.json_object", StructuredOutput("json", ANY_JSON_OBJECT))
            )
        return out


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
    # vLLM's: each choice also carries the token ids it generated (`token_ids`: a stream's
    # chunk, its own) and its prompt's (`prompt_token_ids`: a stream's first chunk of it).
    return_token_ids: bool = False

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


class FunctionCallModel(_Body):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallModel(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallModel


class ChatMessageModel(_Body):
    # "developer" is OpenAI's newer name for system instructions; "tool" carries a tool's
    # result back to the model.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallModel] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # the call a tool message answers
    reasoning_content: str | None = None  # an earlier turn's reasoning (not shown again)

    @model_validator(mode="after")
    def _content_unless_calls(self) -> ChatMessageModel:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                "content: give the message's text (only an assistant turn with tool_calls may "
                "leave it out)"
            )
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message has them")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Body):
    # OpenAI's rule for function names.
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolModel(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessageModel], Field(min_length=1)]
    max_tokens: Annotated[Integer, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[Integer, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[Integer, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[ToolModel], Field(max_length=MAX_TOOLS)] = []
    # Default: "auto" with tools, "none" without.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # several calls in one turn (no effect without tools)
    # vLLM's chat extras, at their neutral values only.
    echo: Annotated[OnlyFalse, neutral("false")] = False
    add_generation_prompt: Annotated[OnlyTrue, neutral("true")] = True
    continue_final_message: Annotated[OnlyFalse, neutral("false")] = False
    add_special_tokens: Annotated[OnlyFalse, neutral("false")] = False
    return_token_ids: Annotated[OnlyFalse, neutral("false")] = False
    documents: Unsupported = None
    chat_template: Unsupported = None
    # Extra variables for the chat template (Qwen3's `enable_thinking`, ...).
    chat_template_kwargs: dict[str, Any] = {}
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

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be distinct")
        if choice in ("required",) and not self.tools:
            raise ValueError('tool_choice: "required" needs tools')
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice: {choice.function.name!r} is not one of the tools ({names})"
            )
        return self

    def effective_tool_choice(self) -> str:
        """ "none", "auto", "required", or "named" (`tool_choice` names a function)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named"
        return choice or ("auto" if self.tools else "none")

    def num_logprobs(self) -> int | None:
        """Alternatives per generated token to report (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None


def validation_error(exc: ValidationError) -> ApiError:
    """The first pydantic error as a 400 naming its field (`messages.0.role`)."""
    first = exc.errors()[0]
    # Union members add their type to the location ("prompt.str"); keep the field path.
    parts = [str(p) for p in first["loc"] if not _is_type_tag(p)]
    if parts[:1] == ["response_format"] and len(parts) > 2:
        del parts[1]  # the format's tag ("json_schema"), which the field path repeats
    param = ".".join(parts) or None
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = f"unsupported parameter {param!r}"
    elif first["type"] == "missing":
        message = f"missing required field {param!r}"
    else:
        message = message.removeprefix("Value error, ")
        # A model's own check names its field first ("content: ..."): the param names it too.
        named = re.match(r"([a-z_]+): ", message)
        if named and (not parts or parts[-1] != named.group(1)):
            param = ".".join([*parts, named.group(1)])
            message = message[named.end() :]
        message = f"{param}: {message}"
    return ApiError(400, message, param=param, code=first["type"])


def ignored_fields(body: BaseModel, where: str = "") -> list[str]:
    """The fields of `body` (nested models included) that no model defines, by path."""
    out = [f"{where}{name}" for name in body.model_extra or {}]
    for name in type(body).model_fields:
        value = getattr(body, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                index = f".{i}" if isinstance(value, list) else ""
                out.extend(ignored_fields(item, f"{where}{name}{index}."))
    return out


def _is_type_tag(part: object) -> bool:
    if not isinstance(part, str):
        return False
    return part in ("str", "int", "float", "bool", "none") or part.startswith(
        ("list[", "constrained-", "literal[", "function-")
    )


class TokenizeRequest(_Body):
    """vLLM's `/tokenize`: a completion prompt, or a chat's messages (with its tools)."""

    model: str | None = None
    prompt: Annotated[str, Field(min_length=1)] | None = None
    messages: Annotated[list[ChatMessageModel], Field(min_length=1)] | None = None
    tools: Annotated[list[ToolModel], Field(max_length=MAX_TOOLS)] = []
    chat_template_kwargs: dict[str, Any] = {}
    add_special_tokens: bool = True
    add_generation_prompt: Annotated[OnlyTrue, neutral("true")] = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give either prompt or messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
