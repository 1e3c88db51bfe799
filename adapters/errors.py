"""Typed adapter errors; the platform maps them to HTTP statuses in one place."""
from __future__ import annotations


class AdapterError(Exception):
    """Base class of every error `loraplex.adapters` raises at its boundary."""


class AdapterValidationError(AdapterError):
    """An adapter is malformed or uses a feature loraplex does not serve.

    `reason` names the problem in plain words, fit to show an operator as-is.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class AdapterNotFoundError(AdapterError, LookupError):
    """No adapter is registered under that name or digest."""


class InvalidAdapterNameError(AdapterError, ValueError):
    """An adapter name breaks the naming rules (see `store.NAME_RE`)."""
