"""Typed errors of the router, raised at its boundary."""
from __future__ import annotations

from loraplex.engine.errors import EngineOverloadedError


class NoCapacityError(EngineOverloadedError):
    """No worker can take the request now (none accepting, or every one at its in-flight bound).

    A subclass of `EngineOverloadedError`, so the gateway answers 503 with Retry-After;
    `retry_after` is the router's suggestion in seconds.
    """

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StatsError(ValueError):
    """A worker's stats document is malformed (names the field at fault)."""


class DiscoveryError(RuntimeError):
    """Worker discovery failed (a DNS name that does not resolve, a bad worker address)."""
