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


class AdapterTooLargeError(AdapterValidationError):
    """An upload (or one of its files) is larger than any adapter for this base model can be."""


class AdapterArchiveError(AdapterValidationError):
    """An uploaded .zip is unsafe or malformed: escaping paths, links, encryption, a bomb."""


class AdapterPatternTimeoutError(AdapterValidationError):
    """A regular expression from adapter_config.json ran past its time bound."""

    def __init__(self, pattern: str, field: str, seconds: float) -> None:
        super().__init__(
            f"{field} pattern {pattern!r} took more than {seconds:g}s to match the base model's "
            "module names (catastrophic backtracking?); list the module names instead"
        )
        self.pattern = pattern
        self.field = field


class AdapterCorruptedError(AdapterError):
    """Stored adapter bytes do not hash to the digest they are stored under."""


class BlobStoreError(AdapterError):
    """The shared adapter blob store is unreachable or misconfigured."""
