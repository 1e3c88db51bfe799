"""Per-client throttling of failed authentication (API keys and admin sign-in).

A token bucket per client address that only failures spend: a client that keeps
presenting wrong credentials gets 429 with Retry-After before its attempt costs a hash
or a database query, while clients that authenticate correctly are never slowed. The
table of addresses is bounded (least recently seen forgotten first), so a flood from
many addresses costs memory that does not grow without bound.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request


@dataclass(frozen=True)
class ThrottleConfig:
    # Failures a client may make in a burst, and how fast its allowance comes back.
    burst: int = 20
    per_second: float = 1.0
    max_clients: int = 65_536


class FailureThrottle:
    """Thread-safe: used from the event loop and from worker threads."""

    def __init__(self, config: ThrottleConfig = ThrottleConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        if config.burst < 1 or config.per_second <= 0:
            raise ValueError("a throttle needs burst >= 1 and per_second > 0")
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, stamp)

    def _tokens(self, client: str, now: float) -> float:
        tokens, stamp = self._buckets.get(client, (float(self.config.burst), now))
        return min(float(self.config.burst), tokens + (now - stamp) * self.config.per_second)

    def __len__(self) -> int:
        """Client addresses remembered now."""
        return len(self._buckets)

    def retry_after(self, client: str) -> float:
        """0 when `client` may try now; else the seconds until its next attempt."""
        with self._lock:
            if client not in self._buckets:
                return 0.0
            tokens = self._tokens(client, self._clock())
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.config.per_second

    def failed(self, client: str) -> None:
        """Spend one attempt of `client`'s allowance."""
        with self._lock:
            now = self._clock()
            tokens = self._tokens(client, now)
            self._buckets[client] = (max(0.0, tokens - 1.0), now)
            self._buckets.move_to_end(client)
            while len(self._buckets) > self.config.max_clients:
                self._buckets.popitem(last=False)


def client_address(request: Request) -> str | None:
    """The caller's address: uvicorn puts a trusted proxy's X-Forwarded-For here."""
    return request.client.host if request.client else None
