"""The served OpenAPI document: the request models, the error model and each route's answers.

The generation routes read their body themselves (size limit, UTF-8 and JSON checks before
pydantic), so FastAPI cannot see their models; this module declares them, so that
schema-driven clients and fuzzers see every field, its type and its bounds.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from hybridserve.server.protocol import ChatCompletionRequest, CompletionRequest

_REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the server answers: OpenAI's shape."""

    error: ErrorDetail


def error_answer(description: str) -> dict[str, Any]:
    """An error answer of a route: JSON in the error model, whatever the route's own type."""
    schema = {"$ref": _REF.format(model=ErrorResponse.__name__)}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


# Answers every authenticated route may give besides its own.
COMMON_ERRORS: dict[int | str, dict[str, Any]] = {
    401: error_answer("Missing or invalid API key (when the server has one)."),
    500: error_answer("Internal error, with an error id that the server log explains."),
}

GENERATION_ERRORS: dict[int | str, dict[str, Any]] = {
    **COMMON_ERRORS,
    400: error_answer("Invalid request: the message names the field and the fix."),
    404: error_answer("The model is not served here."),
    413: error_answer("The body is larger than --max-request-bytes."),
    415: error_answer("The body is not Content-Type: application/json."),
    503: error_answer("Shutting down, the engine is dead, or the queue is full (Retry-After)."),
}


def generation_route(model: type[BaseModel], streamed: str) -> dict[str, Any]:
    """`openapi_extra` and `responses` for a POST route whose body is `model`."""
    return {
        "openapi_extra": {
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}
                },
            }
        },
        "responses": {
            **GENERATION_ERRORS,
            200: {
                "description": f"The {streamed}; with stream: true, server-sent events ending "
                "with data: [DONE].",
                "content": {
                    "application/json": {"schema": {"type": "object"}},
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            },
        },
    }


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document with the request models in its components (built once)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    document = get_openapi(
        title=app.title,
        version=app.version,
        description="An OpenAI-compatible API (completions and chat completions).",
        routes=app.routes,
    )
    _, definitions = models_json_schema(
        [
            (CompletionRequest, "validation"),
            (ChatCompletionRequest, "validation"),
            (ErrorResponse, "serialization"),
        ],
        ref_template=_REF,
    )
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(definitions.get("$defs", {}))
    app.openapi_schema = document
    return document
