"""The OpenAI-compatible FastAPI app: routes, validation, SSE streaming, auth, /metrics.

Every error is OpenAI-shaped: `{"error": {"message", "type", "param", "code"}}`. A request is
checked completely (body size, UTF-8, JSON, fields, model, context room) before anything is
queued, so a rejected request leaves no trace in the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest

from hybridserve.core.errors import RequestError
from hybridserve.core.request import Request, SamplingParams
from hybridserve.server.async_engine import AsyncEngine
from hybridserve.server.backend import EngineParts, ServingBackend
from hybridserve.server.generation import Piece, generate
from hybridserve.server.metrics import Sample, ServerMetrics
from hybridserve.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_error,
)
from hybridserve.server.responses import ChatFormat, CompletionFormat, ResponseFormat
from hybridserve.server.tokenizer import ChatMessage


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerSettings:
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_waiting: int = 1024  # accepted-but-unadmitted requests before answering 503
    retry_after_s: int = 1
    debug_checks: bool = False  # check the cache's invariants after every step
    # max_tokens of a chat request that gives none (bounded by the room under max_model_len).
    default_max_tokens: int = 2048


class ServerState:
    """What the routes share. Built once per app."""

    def __init__(
        self, backend: ServingBackend, parts: EngineParts, settings: ServerSettings
    ) -> None:
        self.backend = backend
        self.parts = parts
        self.settings = settings
        self.model_name = backend.model_name
        self.tokenizer = backend.tokenizer
        self.max_model_len = parts.scheduler.config.max_model_len
        self.metrics = ServerMetrics(backend.model_name)
        self.engine = AsyncEngine(
            parts, pace_s=backend.pace_s, metrics=self.metrics, debug_checks=settings.debug_checks
        )
        self.metrics.attach(self.engine_samples)
        self.ids = itertools.count()
        self.created = int(time.time())

    def engine_samples(self) -> list[Sample]:
        """Scheduler and cache state for /metrics, read under the engine lock."""
        with self.engine.lock:
            scheduler, cache = self.parts.scheduler, self.parts.cache
            controls = scheduler.controls.stats.samples()
            cache_samples = cache.metrics.samples(
                registered=cache.registered_blocks(), evicted=cache.evicted_blocks()
            )
            gauges = [
                ("hybridserve:num_requests_running", float(len(scheduler.running))),
                ("hybridserve:num_requests_waiting", float(scheduler.num_waiting)),
                ("hybridserve:kv_cache_usage_perc", cache.usage()),
                ("hybridserve:kv_cache_free_blocks", float(cache.num_free_blocks)),
            ]
        out: list[Sample] = [(name, {}, value, "gauge") for name, value in gauges]
        for name, kind, value in controls:
            out.append((name.removesuffix("_total"), {}, float(value), kind))
        for name, labels, value in cache_samples:
            kind = "counter" if name.endswith("_total") else "gauge"
            out.append((name.removesuffix("_total"), labels, float(value), kind))
        return out


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(state.engine.stop)
            await asyncio.to_thread(state.backend.close)

    app = FastAPI(title="hybridserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.hybridserve = state
    app.add_exception_handler(ApiError, _api_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error_response)  # type: ignore[arg-type]
    auth = Depends(_auth_check(state.settings.api_key))

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.running:
            reason = state.engine.failure or "the engine loop is not running"
            raise ApiError(503, reason, kind="server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", dependencies=[auth])
    async def models() -> Response:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "hybridserve",
            "max_model_len": state.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics", dependencies=[auth])
    def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", dependencies=[auth])
    async def completions(http: HttpRequest) -> Response:
        body = _parse(CompletionRequest, await _read_json(http, state.settings.max_request_bytes))
        if isinstance(body.prompt, str):
            text = body.prompt
            prompt_ids = _encode(lambda: state.tokenizer.encode(text), "prompt")
        else:
            prompt_ids = body.prompt
            vocab = state.tokenizer.vocab_size
            if not all(0 <= t < vocab for t in prompt_ids):
                raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
        fmt = CompletionFormat(state.model_name, f"cmpl-{next(state.ids)}", state.created)
        return await _serve(
            state,
            http,
            body=body,
            prompt_ids=prompt_ids,
            max_tokens=body.max_tokens,
            prompt_field="prompt",
            fmt=fmt,
        )

    @app.post("/v1/chat/completions", dependencies=[auth])
    async def chat_completions(http: HttpRequest) -> Response:
        body = _parse(
            ChatCompletionRequest, await _read_json(http, state.settings.max_request_bytes)
        )
        messages = [ChatMessage(m.role, m.text()) for m in body.messages]
        prompt_ids = _encode(lambda: state.tokenizer.apply_chat_template(messages), "messages")
        fmt = ChatFormat(state.model_name, f"chatcmpl-{next(state.ids)}", state.created)
        return await _serve(
            state,
            http,
            body=body,
            prompt_ids=prompt_ids,
            max_tokens=body.requested_max_tokens(),
            prompt_field="messages",
            fmt=fmt,
        )

    return app


async def _serve(
    state: ServerState,
    http: HttpRequest,
    *,
    body: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    max_tokens: int | None,
    prompt_field: str,
    fmt: ResponseFormat,
) -> Response:
    request, stops = _make_request(
        state, body, prompt_ids=prompt_ids, max_tokens=max_tokens, prompt_field=prompt_field
    )
    _admission_check(state)
    pieces = generate(
        engine=state.engine,
        metrics=state.metrics,
        tokenizer=state.tokenizer,
        request=request,
        stops=stops,
        http=http,
    )
    num_prompt = len(prompt_ids)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(fmt, pieces, num_prompt, include_usage), media_type="text/event-stream"
        )
    text: list[str] = []
    last = Piece("", "abort", 0)
    async for piece in pieces:
        text.append(piece.text)
        last = piece
    return JSONResponse(
        fmt.full("".join(text), last.finish_reason, num_prompt, last.num_output_tokens)
    )


async def _sse(
    fmt: ResponseFormat, pieces: AsyncIterator[Piece], num_prompt: int, include_usage: bool
) -> AsyncIterator[bytes]:
    yield _event(fmt.first_chunk())
    num_output = 0
    try:
        async for piece in pieces:
            num_output = piece.num_output_tokens
            yield _event(fmt.chunk(piece.text, piece.finish_reason))
    except ApiError as exc:
        yield _event(exc.body())
    if include_usage:
        yield _event(fmt.usage_chunk(num_prompt, num_output))
    yield b"data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _make_request(
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    *,
    prompt_ids: list[int],
    max_tokens: int | None,
    prompt_field: str,
) -> tuple[Request, list[str]]:
    if body.model != state.model_name:
        raise ApiError(
            404,
            f"model {body.model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )
    room = state.max_model_len - len(prompt_ids)
    if room < 1:
        raise ApiError(
            400,
            f"{prompt_field}: {len(prompt_ids)} prompt tokens leave no room under "
            f"max_model_len={state.max_model_len}",
            param=prompt_field,
        )
    if max_tokens is None:
        max_tokens = min(room, state.settings.default_max_tokens)
    elif max_tokens > room:
        raise ApiError(
            400,
            f"max_tokens={max_tokens} exceeds max_model_len={state.max_model_len} minus "
            f"{len(prompt_ids)} prompt tokens ({room})",
            param="max_tokens",
        )
    stop_ids = list(body.stop_token_ids or [])
    if not body.ignore_eos:
        stop_ids += state.tokenizer.eos_token_ids
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            seed=body.seed,
            stop_token_ids=tuple(dict.fromkeys(stop_ids)),
        )
        request = Request(
            req_id=f"req-{next(state.ids)}",
            prompt_token_ids=tuple(prompt_ids),
            sampling=sampling,
            arrival_time=state.engine.now(),
            priority=body.priority,
            cache_salt=body.cache_salt,
        )
    except RequestError as exc:
        param = prompt_field if exc.field == "prompt_token_ids" else exc.field
        raise ApiError(400, str(exc), param=param) from None
    if body.priority != 0 and state.parts.scheduler.config.policy.value == "fcfs":
        raise ApiError(400, "priority: the fcfs scheduler takes priority 0 only", param="priority")
    return request, body.stop_list()


def _admission_check(state: ServerState) -> None:
    if not state.engine.running:
        raise ApiError(503, "the server is shutting down", kind="server_error", code="shutdown")
    queued = state.engine.num_queued()
    if queued >= state.settings.max_waiting:
        raise ApiError(
            503,
            f"the waiting queue is full ({queued} requests); retry later",
            kind="server_error",
            code="queue_full",
            headers={"Retry-After": str(state.settings.retry_after_s)},
        )


async def _read_json(http: HttpRequest, limit: int) -> Any:
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(
            400, f"body is not valid UTF-8 (byte {exc.start})", param="body", code="invalid_utf8"
        ) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"body is not JSON: {exc}", param="body", code="invalid_json") from None
    if not isinstance(value, dict):
        raise ApiError(400, "body must be a JSON object", param="body", code="invalid_json")
    return value


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413, f"body of {size} bytes exceeds {limit}", param="body", code="request_too_large"
    )


_Body = TypeVar("_Body", CompletionRequest, ChatCompletionRequest)


def _parse(model: type[_Body], value: Any) -> _Body:
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _encode(encode: Callable[[], list[int]], field: str) -> list[int]:
    try:
        ids = encode()
    except UnicodeEncodeError:
        raise ApiError(400, f"{field}: text is not valid Unicode", param=field) from None
    if not ids:
        raise ApiError(400, f"{field}: the prompt is empty", param=field)
    return ids


def _auth_check(api_key: str | None) -> Callable[[HttpRequest], None]:
    expected = f"Bearer {api_key}".encode() if api_key else b""

    def check(http: HttpRequest) -> None:
        if not api_key:
            return
        given = http.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, expected):
            raise ApiError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                kind="authentication_error",
                code="invalid_api_key",
            )

    return check


async def _api_error_response(_: HttpRequest, exc: ApiError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error_response(_: HttpRequest, exc: HTTPException) -> Response:
    error = ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code))
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)
