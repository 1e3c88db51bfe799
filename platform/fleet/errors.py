"""Typed errors a worker's reply turns back into, and the gateway's own transport errors.

A worker answers every failure with `{"error": {"type": <class name>, "message": ...}}`;
`error_from_body` rebuilds the class the worker raised when it is one the gateway knows,
so the OpenAI layer maps it to the same status an in-process engine would get.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraplex.adapters import errors as adapter_errors
from loraplex.engine import errors as engine_errors
from loraplex.platform import errors as platform_errors


class WorkerError(engine_errors.EngineDeadError):
    """A worker failed in a way the gateway cannot name more precisely (503, no internals)."""


class WorkerUnreachableError(WorkerError):
    """No answer from the worker (refused, reset, timed out) before it sent any output."""


class WorkerLostError(WorkerError):
    """The worker went away in the middle of a response, after it sent output."""


# The classes a client may see the meaning of; anything else a worker raises (a store it
# cannot reach, a kernel failure) reaches the client as a generic WorkerError.
_KNOWN: dict[str, type[Exception]] = {cls.__name__: cls for cls in (
    engine_errors.InvalidRequestError, engine_errors.PromptTooLongError, engine_errors.UnknownAdapterError,
    engine_errors.EngineOverloadedError, engine_errors.EngineDeadError, adapter_errors.AdapterNotFoundError,
    adapter_errors.InvalidAdapterNameError, platform_errors.ShuttingDownError, platform_errors.BadRequestError,
)}

# Refusals another worker may well accept: retried there (once) before any output.
RETRYABLE: tuple[type[Exception], ...] = (engine_errors.EngineOverloadedError, engine_errors.EngineDeadError,
                                          platform_errors.ShuttingDownError)


def error_from_body(body: Any, status: int) -> Exception:
    """The typed error a worker's error body names; a generic WorkerError for anything else."""
    err = body.get("error") if isinstance(body, Mapping) else None
    kind = err.get("type") if isinstance(err, Mapping) else None
    message = err.get("message") if isinstance(err, Mapping) else None
    cls = _KNOWN.get(kind) if isinstance(kind, str) else None
    if cls is None or not isinstance(message, str):
        return WorkerError(f"an engine worker failed (HTTP {status})")
    try:
        return cls(message)
    except TypeError:  # a class whose constructor wants more than a message
        return WorkerError(f"an engine worker failed (HTTP {status})")
