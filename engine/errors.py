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
