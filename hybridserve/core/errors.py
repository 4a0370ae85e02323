"""Error types shared by every layer; messages name the field, the value and the fix."""

from __future__ import annotations


class HybridServeError(Exception):
    """Base class of every error hybridserve raises on purpose."""


class ConfigError(HybridServeError, ValueError):
    """A configuration value is invalid. The message names the field, the value and the fix."""

    def __init__(self, field: str, value: object, fix: str) -> None:
        self.field = field
        self.value = value
        self.fix = fix
        super().__init__(f"{field}={value!r} is invalid: {fix}")


class RequestError(HybridServeError, ValueError):
    """A request is invalid. Nothing was queued."""

    def __init__(self, field: str, value: object, fix: str) -> None:
        self.field = field
        self.value = value
        self.fix = fix
        super().__init__(f"request field {field}={value!r} is invalid: {fix}")


class IllegalTransition(HybridServeError):
    """A request was moved between two states that the state machine does not connect."""

    def __init__(self, req_id: str, current: object, target: object) -> None:
        super().__init__(f"request {req_id!r}: illegal transition {current} -> {target}")


class CacheInvariantError(HybridServeError, AssertionError):
    """The KV cache's bookkeeping broke an invariant of SPEC.md section 8."""
