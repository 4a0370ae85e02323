"""Reading a request body: size-bounded, UTF-8, JSON, then validated by its model, each
failure an OpenAI-shaped 400 (or 413) naming what is wrong."""

from __future__ import annotations

import json
import logging
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest

from hybridserve.server.protocol import ApiError, validation_error

logger = logging.getLogger(__name__)


async def read_json(http: HttpRequest, limit: int) -> Any:
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    try:
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
    except ClientDisconnect:
        # Nobody reads the answer; say why in the log without a traceback.
        logger.info("client disconnected after %d bytes of the request body", size)
        raise ApiError(400, "the client disconnected", param="body", code="disconnected") from None
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
    except RecursionError:
        raise ApiError(
            400, "body is nested too deeply to parse", param="body", code="invalid_json"
        ) from None
    except ValueError:  # an integer literal past Python's digit limit
        raise ApiError(
            400, "body has an integer with too many digits", param="body", code="invalid_json"
        ) from None
    if not isinstance(value, dict):
        raise ApiError(400, "body must be a JSON object", param="body", code="invalid_json")
    return value


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413, f"body of {size} bytes exceeds {limit}", param="body", code="request_too_large"
    )


_Model = TypeVar("_Model", bound=BaseModel)


def parse_body(model: type[_Model], value: Any) -> _Model:
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise ApiError(
            400, "body is nested too deeply to validate", param="body", code="invalid_json"
        ) from None
