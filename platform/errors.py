"""Typed platform errors, and the ONE place where every error becomes an HTTP status.

Routes raise domain errors (platform, engine or adapter ones); `ERRORS` maps each class
to an `ApiError`, found by the exception's class hierarchy (`api_error()`), and
`error_response()` renders OpenAI's error body:
`{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from loraplex.adapters.errors import (
    AdapterCorruptedError,
    AdapterNotFoundError,
    AdapterValidationError,
    BlobStoreError,
    InvalidAdapterNameError,
)
from loraplex.engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    PromptTooLongError,
    StreamStalledError,
    UnknownAdapterError,
)
from loraplex.engine.errors import TenantShareExceededError
from loraplex.engine.structured.compile_pool import GrammarQueueFullError, GrammarShareBusyError, GrammarTimeoutError
from loraplex.platform.observability.request_id import current_request_id


class PlatformError(Exception):
    """Base class of errors the platform raises at its boundary."""


class ConfigError(PlatformError):
    """Bad settings or a bad environment (database URL, missing files...)."""


class WeakSecretError(ConfigError):
    """A configured secret too short to be one: a usage error (the CLI exits 2)."""


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


class RegistryUnavailableError(PlatformError):
    """An adapter name could not be resolved in time (the registry's database is slow or
    locked): retry shortly."""


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
        """OpenAI's error body, with the request id (when one is bound) to quote to support."""
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        rid = current_request_id()
        if rid is not None:
            err["request_id"] = rid
        return {"error": err}


def _not_found_model(_exc: BaseException) -> ApiError:
    # The engine's or the store's wording may name internals; say what ModelNotFoundError says.
    return ApiError(404, "The requested model does not exist or you do not have access to it.",
                    "invalid_request_error", "model_not_found", "model")


def _rate_limited(exc: BaseException) -> ApiError:
    retry = str(max(1, int(round(getattr(exc, "retry_after", 1.0)))))
    return ApiError(429, _msg(exc), "rate_limit_error", "rate_limit_exceeded", headers={"Retry-After": retry})


def _http(exc: BaseException) -> ApiError:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return ApiError(exc.status_code, str(exc.detail), kind, headers=dict(exc.headers or {}))


def _msg(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _simple(status: int, type_: str, code: str | None = None, param: str | None = None,
            headers: dict[str, str] | None = None) -> Callable[[BaseException], ApiError]:
    return lambda exc: ApiError(status, _msg(exc), type_, code, param, dict(headers or {}))


# Each domain error class -> its OpenAI error. A subclass not listed gets its nearest
# listed base class's mapping (the lookup Starlette's exception_handlers make).
ERRORS: dict[type[BaseException], Callable[[BaseException], ApiError]] = {
    BadRequestError: lambda exc: ApiError(400, _msg(exc), "invalid_request_error", param=getattr(exc, "param", None)),
    InvalidRequestError: lambda exc: ApiError(400, getattr(exc, "reason", _msg(exc)), "invalid_request_error"),
    AdapterValidationError: lambda exc: ApiError(400, getattr(exc, "reason", _msg(exc)), "invalid_request_error"),
    InvalidAdapterNameError: lambda exc: ApiError(400, getattr(exc, "reason", _msg(exc)), "invalid_request_error"),
    PromptTooLongError: _simple(413, "invalid_request_error", "context_length_exceeded"),
    AuthenticationError: _simple(401, "authentication_error", "invalid_api_key"),
    AdminAuthenticationError: _simple(401, "authentication_error", "invalid_admin_credentials",
                                      headers={"WWW-Authenticate": 'Bearer realm="loraplex-admin"'}),
    PermissionDeniedError: _simple(403, "permission_error", "permission_denied"),
    CsrfError: _simple(403, "permission_error", "csrf_failed"),
    ModelNotFoundError: _simple(404, "invalid_request_error", "model_not_found", "model"),
    UnknownAdapterError: _not_found_model,
    AdapterNotFoundError: _not_found_model,
    NotFoundError: _simple(404, "not_found_error", "not_found"),
    ConflictError: _simple(409, "invalid_request_error", "conflict"),
    # The rest of the body is never read: the connection closes after the answer.
    PayloadTooLargeError: _simple(413, "invalid_request_error", "payload_too_large", headers={"Connection": "close"}),
    UnsupportedMediaTypeError: _simple(415, "invalid_request_error", "unsupported_media_type"),
    RateLimitedError: _rate_limited,
    # The tenant's own flood, not the server's load: 429, with the reason as the code.
    TenantShareExceededError: _simple(429, "rate_limit_error", TenantShareExceededError.reason,
                                      headers={"Retry-After": "1"}),
    EngineOverloadedError: _simple(503, "server_error", "overloaded", headers={"Retry-After": "1"}),
    # The client stopped reading a stream (reported in the stream, whose request was aborted).
    StreamStalledError: _simple(408, "invalid_request_error", "stream_stalled"),
    GrammarTimeoutError: _simple(400, "invalid_request_error", GrammarTimeoutError.code),
    GrammarQueueFullError: _simple(429, "rate_limit_error", "grammar_compile_queue_full", headers={"Retry-After": "1"}),
    GrammarShareBusyError: _simple(429, "rate_limit_error", "grammar_compile_share_busy", headers={"Retry-After": "1"}),
    MeteringUnavailableError: _simple(503, "server_error", "metering_unavailable", headers={"Retry-After": "5"}),
    RegistryUnavailableError: _simple(503, "server_error", "adapter_registry_unavailable",
                                      headers={"Retry-After": "5"}),
    EngineDeadError: _simple(503, "server_error", "unavailable"),
    ShuttingDownError: _simple(503, "server_error", "unavailable"),
    # The database is unreachable (the message would name its host): retry later.
    OperationalError: lambda _exc: ApiError(503, "the database is unavailable; retry shortly", "server_error",
                                            "database_unavailable", headers={"Retry-After": "5"}),
    InterfaceError: lambda _exc: ApiError(503, "the database is unavailable; retry shortly", "server_error",
                                          "database_unavailable", headers={"Retry-After": "5"}),
    # The shared adapter store is unreachable (the message would name its URL): retry later.
    BlobStoreError: lambda _exc: ApiError(503, "the adapter store is unavailable; retry shortly", "server_error",
                                          "adapter_store_unavailable", headers={"Retry-After": "5"}),
    # A stored adapter version fails its digest check: an admin must upload it again.
    AdapterCorruptedError: lambda _exc: ApiError(503, "the adapter's stored weights are damaged; an admin must "
                                                 "upload it again", "server_error", "adapter_corrupted"),
    HTTPException: _http,
}


def mapping_of(exc: BaseException) -> Callable[[BaseException], ApiError] | None:
    """The mapping of `exc`'s nearest class in ERRORS, None for an unexpected error."""
    for cls in type(exc).__mro__:
        found = ERRORS.get(cls)
        if found is not None:
            return found
    return None


def api_error(exc: BaseException) -> ApiError:
    """Map any exception to the HTTP status and OpenAI error fields clients see."""
    mapping = mapping_of(exc)
    if mapping is None:
        return ApiError(500, "internal server error", "server_error", "internal_error")
    return mapping(exc)


def error_response(err: ApiError) -> Response:
    return Response(orjson.dumps(err.body()), status_code=err.status, headers=err.headers,
                    media_type="application/json")
