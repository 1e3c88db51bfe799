"""Typed engine errors; the platform maps them to HTTP statuses in one place."""
from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises at its boundary."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is malformed (bad sampling parameters, empty prompt, ...)."""


class PromptTooLongError(InvalidRequestError):
    """The request can never fit: longer than max_model_len or than the whole KV pool."""


class UnknownAdapterError(EngineError, LookupError):
    """The request names an adapter the engine does not have."""


class EngineOverloadedError(EngineError):
    """The engine cannot take more requests right now."""


class EngineDeadError(EngineError):
    """The engine loop stopped (shutdown or a fatal error)."""


class ModelLoadError(EngineError):
    """A model folder is missing, unsupported or inconsistent."""


class StreamStalledError(EngineError):
    """The request's reader fell too far behind its output; the request was aborted."""


class TenantShareExceededError(EngineError):
    """A tenant already fills its share of the waiting queue; the gateway answers 429."""

    reason = "tenant_queue_share_exceeded"

    def __init__(self, tenant: str, waiting: int | None = None, limit: int | None = None) -> None:
        self.tenant, self.waiting, self.limit = tenant, waiting, limit
        if waiting is None or limit is None:  # rebuilt from its message (across a worker hop)
            super().__init__(tenant)
            return
        super().__init__(f"tenant {tenant!r} already has {waiting} requests waiting, its share of the "
                         f"queue is {limit}; retry after some finish")
