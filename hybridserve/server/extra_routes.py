"""vLLM's utility routes that gateways, agent frameworks and dashboards call besides the
OpenAI API: `POST /tokenize` (a prompt, or a chat's messages through the chat template),
`POST /detokenize` and `GET /version`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request as HttpRequest

import hybridserve
from hybridserve.server.bodies import parse_body, read_json
from hybridserve.server.chat import chat_prompt, encode_checked, functions_of, valid_unicode
from hybridserve.server.openapi import COMMON_ERRORS
from hybridserve.server.protocol import ApiError, DetokenizeRequest, TokenizeRequest

if TYPE_CHECKING:
    from hybridserve.server.app import ServerState

TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
EXTRA_BODY_PATHS = frozenset({TOKENIZE_PATH, DETOKENIZE_PATH})


def add_extra_routes(app: FastAPI, state: ServerState) -> None:
    limit = state.settings.max_request_bytes

    @app.post(TOKENIZE_PATH, responses=COMMON_ERRORS)
    async def tokenize(http: HttpRequest) -> Response:
        body = parse_body(TokenizeRequest, await read_json(http, limit))
        _check_model(state, body.model)
        tokenizer = state.tokenizer
        if body.messages is not None:
            functions = functions_of(body.tools)
            ids, _ = chat_prompt(tokenizer, body.messages, functions, body.chat_template_kwargs)
        else:
            text = valid_unicode(body.prompt or "", "prompt")
            encode = tokenizer.encode
            ids = encode_checked(lambda: encode(text), "prompt")
            if not body.add_special_tokens:
                ids = _without_leading_specials(ids, tokenizer.encode(""))
        answer = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        answer["token_strs"] = (
            [tokenizer.token_text(t) for t in ids] if body.return_token_strs else None
        )
        return JSONResponse(answer)

    @app.post(DETOKENIZE_PATH, responses=COMMON_ERRORS)
    async def detokenize(http: HttpRequest) -> Response:
        body = parse_body(DetokenizeRequest, await read_json(http, limit))
        _check_model(state, body.model)
        vocab = state.tokenizer.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise ApiError(400, f"tokens: token ids must be in [0, {vocab})", param="tokens")
        decoder = state.tokenizer.new_decoder()
        return JSONResponse({"prompt": decoder.push(body.tokens) + decoder.flush()})

    @app.get("/version", responses=COMMON_ERRORS)
    async def version() -> Response:
        return JSONResponse({"version": hybridserve.__version__})


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_names:
        raise ApiError(
            404,
            f"model {model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _without_leading_specials(ids: list[int], specials: list[int]) -> list[int]:
    """`ids` without the special tokens the tokenizer puts before every text (its BOS)."""
    if specials and ids[: len(specials)] == specials:
        return ids[len(specials) :]
    return ids
