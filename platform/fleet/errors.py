"""The errors a gateway raises for what its workers answered.

A worker's error body names the domain error it raised (`worker_wire.error_from_body`
rebuilds it). What a client may learn passes on as that class, so the OpenAI layer maps
it to the status an in-process engine would get; anything else (a store the worker cannot
reach, a refused internal token, a type this side lacks) becomes a `WorkerError`: 503,
naming no internals.
"""
from __future__ import annotations

from typing import Any

from loraplex.adapters.errors import AdapterNotFoundError, AdapterValidationError
from loraplex.engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, UnknownAdapterError
from loraplex.platform import worker_wire
from loraplex.platform.errors import ShuttingDownError


class WorkerError(EngineDeadError):
    """A worker failed in a way the gateway does not pass on (503, no internals)."""


class WorkerUnreachableError(WorkerError):
    """No answer from the worker (refused, reset, timed out) before it sent any output."""


class WorkerLostError(WorkerError):
    """The worker went away in the middle of a response, after it sent output."""


_CLIENT_FACING: tuple[type[Exception], ...] = (
    InvalidRequestError, UnknownAdapterError, AdapterNotFoundError, AdapterValidationError,
    EngineOverloadedError, EngineDeadError, ShuttingDownError)

# Refusals another worker may well accept: retried there (once) before any output.
RETRYABLE: tuple[type[Exception], ...] = (EngineOverloadedError, EngineDeadError, ShuttingDownError)


def error_from_body(body: Any, status: int) -> Exception:
    """The error to raise for a worker's error body (HTTP `status`)."""
    err = worker_wire.error_from_body(body)
    if isinstance(err, _CLIENT_FACING) and not isinstance(err, worker_wire.WorkerError):
        return err
    return WorkerError(f"an engine worker failed (HTTP {status}, {type(err).__name__})")
