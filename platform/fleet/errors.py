"""The wire's errors (platform/fleet/WIRE.md), both sides of the hop.

A worker answers a failure with the body `{"error": {"type", "message"}}` naming the domain
error it raised (`error_status`); `decode_error` rebuilds that class on the gateway. What a
client may learn passes on as that class (`error_from_body`), so the OpenAI layer maps it to
the status an in-process engine would get; anything else (a store the worker cannot reach,
a refused internal token, a type this side lacks) becomes a `WorkerError`: 503, naming no
internals.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.exceptions import HTTPException

from loraplex.adapters.errors import (
    AdapterCorruptedError,
    AdapterNotFoundError,
    AdapterValidationError,
    BlobStoreError,
)
from loraplex.engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    StreamStalledError,
    UnknownAdapterError,
)
from loraplex.engine.errors import TenantShareExceededError
from loraplex.engine.structured.compile_pool import GrammarQueueFullError, GrammarShareBusyError

from loraplex.platform.errors import AuthenticationError, RateLimitedError, ShuttingDownError, api_error


class WorkerError(EngineDeadError):
    """A worker failed in a way the gateway does not pass on (503, no internals); also what
    an error body that names no type this side knows decodes to."""


class WorkerUnreachableError(WorkerError):
    """No answer from the worker (refused, reset, timed out) before it sent any output."""


class WorkerLostError(WorkerError):
    """The worker went away in the middle of a response, after it sent output."""


# The domain errors that cross the wire by class name; anything else is a WorkerError.
WIRE_ERRORS: dict[str, type[Exception]] = {cls.__name__: cls for cls in (
    InvalidRequestError, PromptTooLongError, UnknownAdapterError, EngineOverloadedError, EngineDeadError,
    ModelLoadError, ShuttingDownError, AuthenticationError, AdapterNotFoundError, AdapterValidationError,
    AdapterCorruptedError, BlobStoreError, WorkerError, TenantShareExceededError, GrammarQueueFullError,
    GrammarShareBusyError, RateLimitedError, StreamStalledError)}

# A tenant's own flood (TenantShareExceededError and the grammar pool's shares) is its 429
# behind a gateway too, as in process; a worker's throttle of a wrong internal token is not.
_CLIENT_FACING: tuple[type[Exception], ...] = (
    InvalidRequestError, UnknownAdapterError, AdapterNotFoundError, AdapterValidationError,
    EngineOverloadedError, EngineDeadError, ShuttingDownError, TenantShareExceededError)

# Refusals another worker may well accept: retried there (once) before any output.
RETRYABLE: tuple[type[Exception], ...] = (EngineOverloadedError, EngineDeadError, ShuttingDownError)


def error_status(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The worker's HTTP status and error body for `exc`; internals never leave (500: a
    generic body)."""
    if isinstance(exc, BlobStoreError):  # the shared store is unreachable: another worker may do
        return 503, _body("BlobStoreError", "the adapter store is unreachable")
    if isinstance(exc, AdapterCorruptedError):
        return 502, _body("AdapterCorruptedError", str(exc))
    if isinstance(exc, HTTPException):  # no such route or method
        kind = "InvalidRequestError" if exc.status_code < 500 else "WorkerError"
        return exc.status_code, _body(kind, str(exc.detail))
    err = api_error(exc)
    name = next((c.__name__ for c in type(exc).__mro__ if c.__name__ in WIRE_ERRORS), None)
    if name is None:
        return err.status, _body("WorkerError", "the worker failed")
    # (TenantShareExceededError's `reason` is its code, not a message.)
    message = (str(exc) if isinstance(exc, TenantShareExceededError) else getattr(exc, "reason", None)) \
        or str(exc) or name
    return err.status, _body(name, message)


def _body(type_: str, message: str) -> dict[str, Any]:
    return {"error": {"type": type_, "message": message}}


def decode_error(doc: Any) -> Exception:
    """The typed error an error body names (a WorkerError for a type this side lacks)."""
    err = doc.get("error") if isinstance(doc, Mapping) else None
    if not isinstance(err, Mapping):
        return WorkerError("the worker answered with a malformed error")
    message = str(err.get("message") or "the worker failed")
    cls = WIRE_ERRORS.get(str(err.get("type")), WorkerError)
    return cls(message)


def error_from_body(body: Any, status: int) -> Exception:
    """The error the gateway raises for a worker's error body (HTTP `status`)."""
    err = decode_error(body)
    if isinstance(err, _CLIENT_FACING) and not isinstance(err, WorkerError):
        return err
    return WorkerError(f"an engine worker failed (HTTP {status}, {type(err).__name__})")


__all__ = [
    "RETRYABLE",
    "WIRE_ERRORS",
    "WorkerError",
    "WorkerLostError",
    "WorkerUnreachableError",
    "decode_error",
    "error_from_body",
    "error_status",
]
