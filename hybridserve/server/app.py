"""The OpenAI-compatible FastAPI app: routes, validation, SSE streaming, auth, /metrics.

Every error is OpenAI-shaped: `{"error": {"message", "type", "param", "code"}}`. A request is
checked completely (body size, UTF-8, JSON, fields, model, context room) before anything is
queued, so a rejected request leaves no trace in the engine. An unexpected exception answers
a generic 500 with an error id; its text goes to the log under that id, never to the client.

Every path but /health needs the API key when one is set (the OpenAPI schema and unknown paths
included), and POST bodies must be `Content-Type: application/json` (415), so a browser page
on another origin cannot post to the server without a CORS preflight, which fails unless its
origin was allowed with `allow_origins`.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HttpRequest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridserve.core.errors import RequestError
from hybridserve.core.plan import TokenLogprob
from hybridserve.core.request import SEED_MAX, SEED_MIN, Request, SamplingParams, StructuredOutput
from hybridserve.engine.assembly import EngineParts
from hybridserve.engine.step_log import StepLog
from hybridserve.server.async_engine import AsyncEngine, RequestStream, shutdown_error
from hybridserve.server.backend import ServingBackend
from hybridserve.server.bodies import parse_body, read_json
from hybridserve.server.chat import (
    ChatDelta,
    ChatOutput,
    chat_prompt,
    encode_checked,
    request_functions,
    session_id,
    structured_output,
    valid_unicode,
)
from hybridserve.server.extra_routes import EXTRA_BODY_PATHS, add_extra_routes
from hybridserve.server.generation import Piece, generate
from hybridserve.server.metrics import Sample, ServerMetrics
from hybridserve.server.openapi import (
    COMMON_ERRORS,
    error_answer,
    generation_route,
    openapi_document,
)
from hybridserve.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ignored_fields,
    new_error_id,
)
from hybridserve.server.reasoning import reasoning_parser
from hybridserve.server.responses import (
    ChatFormat,
    ChatLogprobs,
    CompletionFormat,
    CompletionLogprobs,
    Usage,
)
from hybridserve.server.tool_parsers import tool_parser

logger = logging.getLogger(__name__)

ResponseFormat = CompletionFormat | ChatFormat

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
# The routes that read a JSON body: only these answer a non-JSON body with 415 (any other
# POST is routed, and answered 404 or 405 as its path says).
BODY_PATHS = frozenset({COMPLETIONS_PATH, CHAT_PATH, *EXTRA_BODY_PATHS})


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerSettings:
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_waiting: int = 1024  # accepted-but-unadmitted requests before answering 503
    retry_after_s: int = 1
    debug_checks: bool = False  # check the cache's invariants after every step
    max_failed_steps: int = 3  # failed executor steps in a row before the engine is dead
    shutdown_timeout_s: float = 30.0  # running requests' time to finish once shutdown begins
    allow_origins: tuple[str, ...] = ()  # browser origins allowed by CORS
    # max_tokens of a chat request that gives none (bounded by the room under max_model_len).
    default_max_tokens: int = 2048
    # The model ids clients use (the first names responses); empty = the backend's own name.
    served_model_names: tuple[str, ...] = ()
    # The watchdog: a step running longer than this kills the engine (0 = no watchdog). Well
    # past the longest real step: a 2,048-token chunk takes ~40 s on a loaded 2-core CPU.
    step_timeout_s: float = 300.0
    # How tool calls are read from chat outputs and written for tool_choice "required" or a
    # named function (vLLM's --tool-call-parser); see tool_parsers.TOOL_PARSERS.
    tool_call_parser: str = "hermes"
    # How `<think>` reasoning is split into `reasoning_content` (None: it stays content).
    reasoning_parser: str | None = None
    # Metric names: "hybridserve" (hybridserve:...) or "vllm" (vLLM's own vllm:... names).
    metrics_names: str = "hybridserve"
    # Before its first step the engine runs one untimed step of this many prompt tokens, at
    # most the token budget (0: none; see ServingBackend.warm_up).
    warm_up_tokens: int = 2048
    # A JSON line per engine step (hybridserve.engine.step_log) written here; None: no log.
    step_log: Path | None = None


class ServerState:
    """What the routes share. Built once per app."""

    def __init__(
        self, backend: ServingBackend, parts: EngineParts, settings: ServerSettings
    ) -> None:
        self.backend = backend
        self.parts = parts
        self.settings = settings
        # The ids clients may put in `model`; responses name the first (vLLM's
        # --served-model-name).
        self.model_names = settings.served_model_names or (backend.model_name,)
        self.model_name = self.model_names[0]
        self.tokenizer = backend.tokenizer
        self.tool_parser = tool_parser(settings.tool_call_parser)
        self.reasoning_parser = (
            reasoning_parser(settings.reasoning_parser) if settings.reasoning_parser else None
        )
        self.max_model_len = parts.scheduler.config.max_model_len
        self.metrics = ServerMetrics(self.model_name, settings.metrics_names)
        self.engine = AsyncEngine(
            parts,
            pace_s=backend.pace_s,
            metrics=self.metrics,
            debug_checks=settings.debug_checks,
            max_failed_steps=settings.max_failed_steps,
            retry_after_s=settings.retry_after_s,
            step_timeout_s=settings.step_timeout_s,
            snapshot=self._engine_samples,
            warm_up=self._warm_up if settings.warm_up_tokens else None,
            step_log=None
            if settings.step_log is None
            else StepLog(settings.step_log, layout=parts.layout),
        )
        self.engine.on_dead = self._engine_died
        self.metrics.attach(lambda: list(self.engine.snapshot))
        self.ids = itertools.count()
        self.created = int(time.time())
        self.draining = False  # shutdown began: new requests get 503
        self.exit_code = 0  # what the process should exit with once the server stops
        self.request_exit: Callable[[], None] | None = None  # set by the server that runs us

    def _warm_up(self) -> str:
        budget = self.parts.scheduler.config.max_num_batched_tokens
        tokens = self.backend.warm_up(min(self.settings.warm_up_tokens, budget))
        return f"{tokens} prompt tokens in one step" if tokens else "nothing to warm"

    def _engine_samples(self) -> list[Sample]:
        """Scheduler and cache state for /metrics; the engine thread calls it, holding the
        engine lock, after each step (scrapes read the last snapshot)."""
        engine, cache = self.parts.engine, self.parts.cache
        controls = engine.control_samples()
        cache_samples = cache.metrics.samples(
            registered=cache.registered_blocks(), evicted=cache.evicted_blocks()
        )
        gauges = [
            ("hybridserve:num_requests_running", float(engine.num_running)),
            ("hybridserve:num_requests_waiting", float(engine.num_waiting)),
            ("hybridserve:kv_cache_usage_perc", cache.usage()),
            ("hybridserve:kv_cache_free_blocks", float(cache.num_free_blocks)),
        ]
        out: list[Sample] = [(name, {}, value, "gauge") for name, value in gauges]
        for name, kind, value in controls:
            out.append((name.removesuffix("_total"), {}, float(value), kind))
        for name, value in self.parts.scheduler.metrics_snapshot().items():
            if name.startswith(("hybridserve:kv_pin", "hybridserve:kv_pins")):
                kind = "counter" if name.endswith("_total") else "gauge"
                out.append((name.removesuffix("_total"), {}, float(value), kind))
        for name, labels, value in cache_samples:
            kind = "counter" if name.endswith("_total") else "gauge"
            out.append((name.removesuffix("_total"), labels, float(value), kind))
        return out

    def _engine_died(self) -> None:
        logger.error("%s", self.engine.failure)
        self.exit_code = 1
        if self.request_exit is not None:
            self.request_exit()

    async def drain(self, timeout_s: float, forced: Callable[[], bool] = lambda: False) -> None:
        """Shut down the serving: refuse new requests (503), abort those not started, give the
        running ones `timeout_s` to finish, then cut the rest (streams end with finish_reason
        "abort" and [DONE], whole responses get a 503)."""
        if self.draining:
            return
        self.draining = True
        engine = self.engine
        if not engine.running:
            return
        engine.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while engine.num_streams() and not forced() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if engine.num_streams():
            logger.warning("shutdown: cutting %d requests short", engine.num_streams())
            engine.cut()


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(state.engine.stop)
            await asyncio.to_thread(state.backend.close)

    app = FastAPI(
        title="hybridserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.hybridserve = state
    app.add_exception_handler(ApiError, _api_error_response)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error_response)  # type: ignore[arg-type]
    settings = state.settings
    app.add_middleware(
        _Guard,
        api_key=settings.api_key,
        allow_origins=settings.allow_origins,
        body_paths=BODY_PATHS,
    )
    if settings.allow_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allow_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )

    @app.get("/health", responses={503: error_answer("Shutting down, or the engine is dead.")})
    async def health() -> Response:
        if state.draining:
            raise shutdown_error("the server is shutting down", settings.retry_after_s)
        if not state.engine.running:
            reason = state.engine.failure or "the engine loop is not running"
            raise ApiError(503, reason, kind="server_error", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> Response:
        return JSONResponse(openapi_document(app))

    @app.get("/v1/models", responses=COMMON_ERRORS)
    async def models() -> Response:
        cards = [
            {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "hybridserve",
                "max_model_len": state.max_model_len,
            }
            for name in state.model_names
        ]
        return JSONResponse({"object": "list", "data": cards})

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={**COMMON_ERRORS, 200: {"content": {"text/plain": {}}}},
    )
    def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post(COMPLETIONS_PATH, **generation_route(CompletionRequest, "completion"))
    async def completions(http: HttpRequest) -> Response:
        created = int(time.time())
        body = parse_body(CompletionRequest, await read_json(http, settings.max_request_bytes))
        _warn_ignored(body, COMPLETIONS_PATH)
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(
                400,
                "max_tokens: 0 generates nothing; use 1 or more, or echo: true to score the prompt",
                param="max_tokens",
            )
        if body.logprobs is not None:
            _need_logprobs(state, "logprobs")
        if body.min_tokens:
            _need_model(state, "min_tokens")
        encoded = _completion_prompts(state, body)
        # Compiling a large schema can take a while: off the event loop, which keeps streaming.
        structured = await asyncio.to_thread(
            structured_output, body, state.backend.grammars, state.backend.executor_name
        )
        session = session_id(body, http.headers)
        choices = []
        for number, (prompt_ids, prompt_text) in enumerate(encoded):
            echo: str | None = None
            if body.echo:
                echo = prompt_text if prompt_text is not None else _decode(state, prompt_ids)
            for i in range(body.n):  # OpenAI's order: the n choices of each prompt in turn
                request, stops = _make_request(
                    state,
                    body,
                    prompt_ids=prompt_ids,
                    max_tokens=(max(body.max_tokens, 1), "max_tokens"),
                    prompt_field="prompt",
                    logprobs=body.logprobs,
                    prompt_logprobs=body.logprobs if body.echo else None,
                    structured=structured,
                    session=session,
                    choice=i,
                )
                choices.append(
                    _Choice(
                        number * body.n + i,
                        request,
                        stops,
                        echo=echo,
                        scored_only=body.max_tokens == 0,
                        token_ids=body.return_token_ids,
                    )
                )
        fmt = CompletionFormat(state.model_name, f"cmpl-{next(state.ids)}", created)
        return await _serve(state, http, stream=_stream_flags(body), choices=choices, fmt=fmt)

    @app.post(CHAT_PATH, **generation_route(ChatCompletionRequest, "chat completion"))
    async def chat_completions(http: HttpRequest) -> Response:
        created = int(time.time())
        body = parse_body(ChatCompletionRequest, await read_json(http, settings.max_request_bytes))
        _warn_ignored(body, CHAT_PATH)
        if body.num_logprobs() is not None:
            _need_logprobs(state, "logprobs")
        if body.min_tokens:
            _need_model(state, "min_tokens")
        prompt_ids, messages = chat_prompt(
            state.tokenizer, body.messages, request_functions(body), body.chat_template_kwargs
        )
        structured = await asyncio.to_thread(
            functools.partial(
                structured_output,
                body,
                state.backend.grammars,
                state.backend.executor_name,
                tool_parser=state.tool_parser,
            )
        )
        offered = bool(body.tools) and body.effective_tool_choice() != "none"
        choices = []
        for i in range(body.n):
            request, stops = _make_request(
                state,
                body,
                prompt_ids=prompt_ids,
                max_tokens=body.requested_max_tokens(),
                prompt_field="messages",
                logprobs=body.num_logprobs(),
                structured=structured,
                session=session_id(body, http.headers, messages),
                choice=i,
            )
            output = ChatOutput(state.reasoning_parser, state.tool_parser if offered else None)
            choices.append(_Choice(i, request, stops, output=output))
        fmt = ChatFormat(state.model_name, f"chatcmpl-{next(state.ids)}", created)
        return await _serve(state, http, stream=_stream_flags(body), choices=choices, fmt=fmt)

    add_extra_routes(app, state)
    return app


@dataclass(slots=True)
class _Choice:
    """One prompt of a request and how its output is shown."""

    index: int
    request: Request
    stops: list[str]
    echo: str | None = None  # the prompt text shown before the output (completions' echo)
    scored_only: bool = False  # echo with max_tokens 0: the one generated token is dropped
    started: bool = False  # its first piece went out (a stream shows the echo with it)
    output: ChatOutput | None = None  # a chat choice's reasoning and tool calls, read back
    token_ids: bool = False  # completions' return_token_ids: the ids beside the text


def _completion_prompts(
    state: ServerState, body: CompletionRequest
) -> list[tuple[list[int], str | None]]:
    """Each prompt's token ids, with its text when it came as text."""
    encoded: list[tuple[list[int], str | None]] = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            text = valid_unicode(prompt, "prompt")
            encode = functools.partial(state.tokenizer.encode, text)
            encoded.append((encode_checked(encode, "prompt"), text))
            continue
        vocab = state.tokenizer.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
        encoded.append((prompt, None))
    return encoded


def _warn_ignored(body: CompletionRequest | ChatCompletionRequest, path: str) -> None:
    """Log the fields no OpenAI or vLLM request defines (they are ignored, as vLLM does)."""
    ignored = ignored_fields(body)
    if ignored:
        logger.warning("%s: ignoring fields it does not define: %s", path, ", ".join(ignored))


def _logit_bias(
    state: ServerState, body: CompletionRequest | ChatCompletionRequest
) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token id, bias) pairs: keys are token ids in the vocabulary."""
    if not body.logit_bias:
        return ()
    _need_model(state, "logit_bias")
    vocab = state.tokenizer.vocab_size
    out = []
    for key, bias in body.logit_bias.items():
        if not key.isdigit() or int(key) >= vocab:
            raise ApiError(
                400,
                f"logit_bias: {key!r} is not a token id; use ids in [0, {vocab}) as strings",
                param="logit_bias",
            )
        out.append((int(key), float(bias)))
    return tuple(out)


def _stream_flags(body: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    return body.stream, bool(body.stream_options and body.stream_options.include_usage)


def _need_model(
    state: ServerState, field: str, lacks: str = "whose logits it could change"
) -> None:
    """A 400 naming `field` when the executor has no model (the simulator)."""
    if not state.backend.supports_logprobs:
        raise ApiError(
            400,
            f"{field}: the {state.backend.executor_name} executor has no model {lacks}; "
            "leave it out, or serve a model (--executor torch)",
            param=field,
        )


def _need_logprobs(state: ServerState, field: str) -> None:
    _need_model(state, field, "to return log-probabilities from")


def _decode(state: ServerState, token_ids: Sequence[int]) -> str:
    decoder = state.tokenizer.new_decoder()
    return decoder.push(token_ids) + decoder.flush()


class _Render:
    """Turns one choice's pieces into text and `logprobs` objects."""

    def __init__(self, state: ServerState, fmt: ResponseFormat, choice: _Choice) -> None:
        self.state = state
        self.choice = choice
        self.prompt_ids = choice.request.prompt_token_ids
        sampling = choice.request.sampling
        self.wants_logprobs = sampling.logprobs is not None
        self.wants_prompt_logprobs = sampling.prompt_logprobs is not None
        token_text = state.tokenizer.token_text
        self.completion_logprobs: CompletionLogprobs | None = None
        self.chat_logprobs: ChatLogprobs | None = None
        if self.wants_logprobs and isinstance(fmt, CompletionFormat):
            offset = len(choice.echo) if choice.echo is not None else 0
            self.completion_logprobs = CompletionLogprobs(token_text, output_offset=offset)
        elif self.wants_logprobs:
            self.chat_logprobs = ChatLogprobs(token_text)

    def render(
        self, text: str, logprobs: Sequence[TokenLogprob], prompt_logprobs: Sequence[TokenLogprob]
    ) -> tuple[str, dict[str, Any] | None]:
        """(text, logprobs object) for output that starts where the last call ended; the first
        call shows the echoed prompt with its log-probabilities."""
        choice = self.choice
        first, choice.started = not choice.started, True
        prompt_entries: list[tuple[int, TokenLogprob | None]] = []
        if first and self.wants_prompt_logprobs:
            if len(prompt_logprobs) != len(self.prompt_ids) - 1:
                error_id = new_error_id()
                logger.error(
                    "%s: %d prompt log-probabilities for %d prompt tokens (error id %s)",
                    choice.request.req_id,
                    len(prompt_logprobs),
                    len(self.prompt_ids),
                    error_id,
                )
                raise ApiError(
                    500,
                    f"the executor did not return every prompt log-probability (error id "
                    f"{error_id})",
                    kind="server_error",
                    code="executor_error",
                )
            prompt_entries = [(self.prompt_ids[0], None)]
            prompt_entries += [(e.token_id, e) for e in prompt_logprobs]
        if choice.scored_only:
            text, logprobs = "", ()
        if first and choice.echo is not None:
            text = choice.echo + text
        if self.completion_logprobs is not None:
            return text, self.completion_logprobs.block(prompt_entries, logprobs)
        if self.chat_logprobs is not None:
            return text, self.chat_logprobs.block(logprobs)
        return text, None


async def _serve(
    state: ServerState,
    http: HttpRequest,
    *,
    stream: tuple[bool, bool],
    choices: list[_Choice],
    fmt: ResponseFormat,
) -> Response:
    streams = _admit(state, [c.request for c in choices])
    pieces = [
        generate(
            engine=state.engine,
            metrics=state.metrics,
            tokenizer=state.tokenizer,
            request=c.request,
            stream=s,
            stops=c.stops,
            http=http,
        )
        for c, s in zip(choices, streams, strict=True)
    ]
    renders = [_Render(state, fmt, c) for c in choices]
    num_prompt = sum(c.request.num_prompt_tokens for c in choices)

    def abort_all() -> None:
        for choice in choices:
            state.engine.abort(choice.request.req_id)

    if stream[0]:
        return _EngineStreamingResponse(
            _sse(fmt, renders, pieces, num_prompt, include_usage=stream[1]),
            media_type="text/event-stream",
            on_close=abort_all,
        )
    tasks = [asyncio.ensure_future(_whole(fmt, r, p)) for r, p in zip(renders, pieces, strict=True)]
    try:
        outputs = [await task for task in tasks]
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()  # retrieved: a second failing choice is not logged as lost
        abort_all()  # a no-op unless the handler itself was cancelled or a choice failed
    usage = Usage(num_prompt, sum(n for _, n, _ in outputs), sum(c for _, _, c in outputs))
    return JSONResponse(fmt.full([body for body, _, _ in outputs], usage))


async def _whole(
    fmt: ResponseFormat, render: _Render, pieces: AsyncIterator[Piece]
) -> tuple[dict[str, Any], int, int]:
    """One choice of a whole response, its output tokens and its cached prompt tokens."""
    text: list[str] = []
    logprobs: list[TokenLogprob] = []
    prompt_logprobs: list[TokenLogprob] = []
    token_ids: list[int] = []
    last = Piece("", "abort", 0)
    async for piece in pieces:
        text.append(piece.text)
        logprobs.extend(piece.logprobs)
        prompt_logprobs.extend(piece.prompt_logprobs)
        token_ids.extend(piece.token_ids)
        last = piece
    if last.error is not None:
        raise last.error
    shown, block = render.render("".join(text), logprobs, prompt_logprobs)
    choice = render.choice
    num_output = 0 if choice.scored_only else last.num_output_tokens
    if choice.output is not None and isinstance(fmt, ChatFormat):
        read = choice.output.whole(shown)
        finish = _finish_reason(last.finish_reason, choice.output)
        with_reasoning = choice.output.reads_reasoning
        body = fmt.message_choice(choice.index, read, finish, block, with_reasoning=with_reasoning)
    else:
        body = fmt.choice(choice.index, shown, last.finish_reason, block)
    if choice.token_ids:
        body["prompt_token_ids"] = list(choice.request.prompt_token_ids)
        body["token_ids"] = [] if choice.scored_only else token_ids
    return body, num_output, last.num_cached_tokens


def _finish_reason(reason: str | None, output: ChatOutput) -> str | None:
    """ "tool_calls" for a turn that ended by itself after calling tools, as OpenAI says."""
    return "tool_calls" if reason == "stop" and output.called else reason


class _EngineStreamingResponse(StreamingResponse):
    """A stream whose request is aborted however the response ends, even when it never began
    (a client gone before the first byte), so no engine work outlives its client."""

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], None], **kw: Any):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _sse(
    fmt: ResponseFormat,
    renders: list[_Render],
    pieces: list[AsyncIterator[Piece]],
    num_prompt: int,
    *,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """Server-sent events: each piece of each choice as soon as it is generated (a chat stream
    opens with the assistant role, a completions stream with the first text), the usage if
    asked for, then [DONE]."""
    opening = fmt.first_chunk(len(renders))
    if opening is not None:
        yield _event(opening)
    num_output = [0] * len(renders)
    num_cached = [0] * len(renders)
    ids_sent: set[int] = set()  # choices whose prompt token ids went out
    try:
        async for index, piece in _merged(pieces):
            render = renders[index]
            text, block = render.render(piece.text, piece.logprobs, piece.prompt_logprobs)
            num_cached[index] = piece.num_cached_tokens
            if not render.choice.scored_only:
                num_output[index] = piece.num_output_tokens
            output = render.choice.output
            if output is not None and isinstance(fmt, ChatFormat):
                # Nothing while a call's tag is still arriving; a chunk per tool-call delta.
                for choice in _read_deltas(fmt, render.choice.index, output, piece, text, block):
                    yield _event(fmt.chunk([choice]))
                continue
            choice = fmt.stream_choice(render.choice.index, text, piece.finish_reason, block)
            if render.choice.token_ids:
                _with_token_ids(choice, render.choice, piece, first=index not in ids_sent)
                ids_sent.add(index)
            yield _event(fmt.chunk([choice]))
    except ApiError as exc:
        yield _event(exc.body())
    except Exception:
        yield _event(_internal_error("streaming a response").body())
    if include_usage:
        yield _event(fmt.usage_chunk(Usage(num_prompt, sum(num_output), sum(num_cached))))
    yield b"data: [DONE]\n\n"


def _with_token_ids(choice: dict[str, Any], of: _Choice, piece: Piece, *, first: bool) -> None:
    """vLLM's return_token_ids in a stream: a chunk's generated ids, and its prompt's ids in
    the choice's first chunk."""
    if first:
        choice["prompt_token_ids"] = list(of.request.prompt_token_ids)
    choice["token_ids"] = [] if of.scored_only else list(piece.token_ids)


def _read_deltas(
    fmt: ChatFormat,
    index: int,
    output: ChatOutput,
    piece: Piece,
    text: str,
    block: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """A chat stream's choices for one piece read back: none while nothing shows yet, else
    one per tool-call delta, as OpenAI streams them (the first with the content and the
    log-probabilities, the last with the finish reason)."""
    delta = output.push(text)
    if piece.finish_reason is not None:
        rest = output.finish()
        delta = ChatDelta(
            delta.content + rest.content,
            delta.reasoning + rest.reasoning,
            delta.tool_calls + rest.tool_calls,
        )
    if piece.finish_reason is None and block is None and delta == ChatDelta():
        return []
    calls = delta.tool_calls
    parts = [ChatDelta(delta.content, delta.reasoning, calls[:1])]
    parts += [ChatDelta(tool_calls=(call,)) for call in calls[1:]]
    finish = _finish_reason(piece.finish_reason, output)
    return [
        fmt.delta_choice(
            index, part, finish if i == len(parts) - 1 else None, block if i == 0 else None
        )
        for i, part in enumerate(parts)
    ]


async def _merged(pieces: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """(choice index, piece) from every choice as they come; the first error is raised and
    ends the others (their requests are aborted)."""
    if len(pieces) == 1:
        async for piece in pieces[0]:
            yield 0, piece
        return
    queue: asyncio.Queue[tuple[int, Piece | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, source: AsyncIterator[Piece]) -> None:
        try:
            async for piece in source:
                queue.put_nowait((index, piece, None))
        except Exception as exc:
            queue.put_nowait((index, None, exc))
        else:
            queue.put_nowait((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(pieces)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _make_request(
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    *,
    prompt_ids: list[int],
    max_tokens: tuple[int | None, str],
    prompt_field: str,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    structured: StructuredOutput | None = None,
    session: str | None = None,
    choice: int = 0,
) -> tuple[Request, list[str]]:
    if body.model not in state.model_names:
        served = " or ".join(repr(name) for name in state.model_names)
        raise ApiError(
            404,
            f"model {body.model!r} does not exist; this server serves {served} (GET /v1/models "
            "lists it)",
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
    limit, limit_field = max_tokens
    if limit is None:
        limit = min(room, state.settings.default_max_tokens)
    elif limit > room:
        raise ApiError(
            400,
            f"{limit_field}={limit} exceeds max_model_len={state.max_model_len} minus "
            f"{len(prompt_ids)} prompt tokens ({room})",
            param=limit_field,
        )
    stop_ids = list(body.stop_token_ids or [])
    if not body.ignore_eos:
        stop_ids += state.tokenizer.eos_token_ids
    req_id = f"req-{next(state.ids)}"
    seed = _choice_seed(body.seed, choice, req_id)
    try:
        sampling = SamplingParams(
            max_tokens=limit,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            seed=seed,
            stop_token_ids=tuple(dict.fromkeys(stop_ids)),
            repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured=structured,
            min_tokens=body.min_tokens,
            logit_bias=_logit_bias(state, body),
        )
        cache_salt = body.cache_salt
        if prompt_logprobs is not None:
            # Every prompt position must be computed to have its log-probability, so such a
            # request never resumes from cached blocks (vLLM skips the prefix-cache lookup for
            # them): a salt of its own keeps it off every other request's blocks.
            cache_salt = f"{cache_salt or ''}\x1fprompt-logprobs:{secrets.token_hex(16)}"
        request = Request(
            req_id=req_id,
            prompt_token_ids=tuple(prompt_ids),
            sampling=sampling,
            arrival_time=state.engine.now(),
            priority=body.priority,
            cache_salt=cache_salt,
            session_id=session,
        )
        state.parts.scheduler.config.check_priority(body.priority)  # the one priority rule
    except RequestError as exc:
        param = prompt_field if exc.field == "prompt_token_ids" else exc.field
        if param == "max_tokens":
            param = limit_field
        raise ApiError(400, str(exc), param=param) from None
    return request, body.stop_list()


def _choice_seed(seed: int | None, choice: int, req_id: str) -> int:
    """The seed of a request's `choice`-th choice: a fresh random one when the request gives
    none (unseeded requests must not all draw the same numbers); else one per choice, so the
    choices of a seeded request (n > 1) differ from each other, and repeat."""
    if seed is None:
        drawn = secrets.randbits(63)
        logger.debug("%s: unseeded, drew seed %d", req_id, drawn)
        return drawn
    return (seed + choice - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN


def _admit(state: ServerState, requests: Sequence[Request]) -> list[RequestStream]:
    """The one admission check, streaming or not: refuse or queue all of `requests` (one per
    prompt of a batch), with no await between the check and the queueing, so concurrent
    requests cannot all pass a nearly full check."""
    retry_after = {"Retry-After": str(state.settings.retry_after_s)}
    if state.draining:
        raise shutdown_error("the server is shutting down", state.settings.retry_after_s)
    if not state.engine.running:
        reason = state.engine.failure or "the engine is not running"
        raise ApiError(503, reason, kind="server_error", code="engine_dead", headers=retry_after)
    queued, limit = state.engine.num_queued(), state.settings.max_waiting
    if len(requests) > limit:
        # Never fits, however long the client waits: not a 503 to retry.
        raise ApiError(
            400,
            f"prompt: a batch of {len(requests)} prompts is more than the server queues at once "
            f"(--max-waiting={limit}); send at most {limit} prompts per request",
            param="prompt",
            code="batch_too_large",
        )
    if queued + len(requests) > limit:
        more = f" to queue {len(requests)} more" if len(requests) > 1 else ""
        raise ApiError(
            503,
            f"the waiting queue is full ({queued} requests{more}); retry later",
            kind="server_error",
            code="queue_full",
            headers=retry_after,
        )
    return [state.engine.submit(request) for request in requests]


def _bearer_token(headers: Headers) -> bytes:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else b""


def _internal_error(doing: str) -> ApiError:
    """A generic 500 for an unexpected exception (being handled now), logged under an id."""
    error_id = new_error_id()
    logger.exception("internal error while %s (error id %s)", doing, error_id)
    return ApiError(
        500,
        f"internal server error (error id {error_id})",
        kind="server_error",
        code="internal_error",
    )


class _Guard:
    """Outermost checks: the API key on every path but /health, JSON bodies on POST (415),
    and a generic OpenAI-shaped 500 for any exception a route lets out."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        allow_origins: Sequence[str],
        body_paths: frozenset[str],
    ):
        self.app = app
        self.expected = api_key.encode() if api_key else b""
        self.allow_origins = frozenset(allow_origins)
        self.body_paths = body_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await _error_response(refusal)(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            error = _internal_error(f"serving {scope['method']} {scope['path']}")
            if not started:
                await _error_response(error)(scope, receive, send)

    def _refusal(self, scope: Scope, headers: Headers) -> ApiError | None:
        if (
            self.expected
            and scope["path"] != "/health"
            and not secrets.compare_digest(_bearer_token(headers), self.expected)
        ):
            return ApiError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                kind="authentication_error",
                code="invalid_api_key",
            )
        if (
            scope["method"] == "POST"
            and scope["path"] in self.body_paths
            and headers.get("origin") not in self.allow_origins
        ):
            media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
            if media_type != "application/json":
                return ApiError(
                    415,
                    f"send the body as Content-Type: application/json, not {media_type!r}",
                    param="Content-Type",
                    code="unsupported_media_type",
                )
        return None


def _error_response(exc: ApiError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _api_error_response(_: HttpRequest, exc: ApiError) -> Response:
    return _error_response(exc)


async def _http_error_response(_: HttpRequest, exc: HTTPException) -> Response:
    error = ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code))
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)
