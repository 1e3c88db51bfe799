"""Typed platform errors, and the ONE place where every error becomes an HTTP status.

Routes raise domain errors (platform, engine or adapter ones); `api_error()` maps them
to an `ApiError` and `error_response()` renders OpenAI's error body:
`{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import orjson
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from loraplex.adapters.errors import AdapterNotFoundError, AdapterValidationError, InvalidAdapterNameError
from loraplex.engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    PromptTooLongError,
    UnknownAdapterError,
)


class PlatformError(Exception):
    """Base class of errors the platform raises at its boundary."""


class ConfigError(PlatformError):
    """Bad settings or a bad environment (database URL, missing files...)."""


class BadRequestError(PlatformError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class AuthenticationError(PlatformError):
    """Missing, unknown, revoked or expired API key."""


class PermissionDeniedError(PlatformError):
    """A valid key asked for something its tenant may not have (a higher lane, ...)."""


class ModelNotFoundError(PlatformError):
    """Unknown model/adapter, or one this tenant may not use: the same error for both."""

    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist or you do not have access to it.")
        self.name = name


class NotFoundError(PlatformError):
    """A CLI/admin lookup found nothing (tenant, key prefix...)."""


class ConflictError(PlatformError):
    """Something with that name already exists."""


class RateLimitedError(PlatformError):
    """Over a quota or rate limit; the client should retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDownError(PlatformError):
    """The server is draining: new requests are refused."""


class MeteringUnavailableError(PlatformError):
    """Usage events cannot be written fast enough (database down): new requests are refused
    rather than served unmetered."""


class AdminAuthenticationError(AuthenticationError):
    """Admin API: no admin token or session, or a wrong or expired one."""


class CsrfError(PermissionDeniedError):
    """Admin API: a change made with a session cookie lacks the session's CSRF token."""


class PayloadTooLargeError(PlatformError):
    """A request body (an adapter upload) is over its size limit."""


class UnsupportedMediaTypeError(PlatformError):
    """A request body of a content type the endpoint does not take."""


@dataclass
class ApiError:
    status: int
    message: str
    type: str
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def api_error(exc: BaseException) -> ApiError:
    """Map any exception to the HTTP status and OpenAI error fields clients see."""
    msg = str(exc) or type(exc).__name__
    if isinstance(exc, BadRequestError):
        return ApiError(400, msg, "invalid_request_error", param=exc.param)
    if isinstance(exc, PromptTooLongError):  # before its base class InvalidRequestError
        return ApiError(413, msg, "invalid_request_error", "context_length_exceeded")
    if isinstance(exc, (InvalidRequestError, AdapterValidationError, InvalidAdapterNameError)):
        return ApiError(400, getattr(exc, "reason", msg), "invalid_request_error")
    if isinstance(exc, AdminAuthenticationError):  # before its base class
        return ApiError(401, msg, "authentication_error", "invalid_admin_credentials",
                        headers={"WWW-Authenticate": 'Bearer realm="loraplex-admin"'})
    if isinstance(exc, AuthenticationError):
        return ApiError(401, msg, "authentication_error", "invalid_api_key")
    if isinstance(exc, CsrfError):  # before its base class
        return ApiError(403, msg, "permission_error", "csrf_failed")
    if isinstance(exc, PermissionDeniedError):
        return ApiError(403, msg, "permission_error", "permission_denied")
    if isinstance(exc, ModelNotFoundError):
        return ApiError(404, msg, "invalid_request_error", "model_not_found", "model")
    if isinstance(exc, (UnknownAdapterError, AdapterNotFoundError)):
        # The engine's wording may name internals; say what ModelNotFoundError says.
        return ApiError(404, "The requested model does not exist or you do not have access to it.",
                        "invalid_request_error", "model_not_found", "model")
    if isinstance(exc, NotFoundError):
        return ApiError(404, msg, "not_found_error", "not_found")
    if isinstance(exc, ConflictError):
        return ApiError(409, msg, "invalid_request_error", "conflict")
    if isinstance(exc, PayloadTooLargeError):
        return ApiError(413, msg, "invalid_request_error", "payload_too_large")
    if isinstance(exc, UnsupportedMediaTypeError):
        return ApiError(415, msg, "invalid_request_error", "unsupported_media_type")
    if isinstance(exc, RateLimitedError):
        retry = str(max(1, int(round(exc.retry_after))))
        return ApiError(429, msg, "rate_limit_error", "rate_limit_exceeded", headers={"Retry-After": retry})
    if isinstance(exc, EngineOverloadedError):
        return ApiError(503, msg, "server_error", "overloaded", headers={"Retry-After": "1"})
    if isinstance(exc, MeteringUnavailableError):
        return ApiError(503, msg, "server_error", "metering_unavailable", headers={"Retry-After": "5"})
    if isinstance(exc, (EngineDeadError, ShuttingDownError)):
        return ApiError(503, msg, "server_error", "unavailable")
    if isinstance(exc, (OperationalError, InterfaceError)):  # the database is unreachable: retry later
        return ApiError(503, "the database is unavailable; retry shortly", "server_error", "database_unavailable",
                        headers={"Retry-After": "5"})
    if isinstance(exc, HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return ApiError(exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {}))
    return ApiError(500, "internal server error", "server_error", "internal_error")


def error_response(err: ApiError) -> Response:
    return Response(orjson.dumps(err.body()), status_code=err.status, headers=err.headers,
                    media_type="application/json")
