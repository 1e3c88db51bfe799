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


class TokenBuckets:
    """Token buckets by key, each holding at most `burst` and refilled at `rate` a second;
    at most `max_keys` remembered (least recently spent from forgotten first: a forgotten
    key starts full again). Thread-safe."""

    def __init__(self, burst: float, rate: float, max_keys: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.rate, self.max_keys, self._clock = burst, rate, max_keys, clock
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, stamp)

    def __len__(self) -> int:
        return len(self._buckets)

    def _level(self, key: str, now: float) -> float:
        tokens, stamp = self._buckets.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - stamp) * self.rate)

    def level(self, key: str) -> float:
        """The tokens `key` holds now (`burst` for a key never spent from)."""
        with self._lock:
            return self._level(key, self._clock())

    def take(self, key: str, amount: float, floor: float | None = 0.0) -> float:
        """Spend `amount` of `key`'s tokens, never below `floor` (None: a debt may build);
        returns the tokens left."""
        with self._lock:
            now = self._clock()
            left = self._level(key, now) - amount
            if floor is not None:
                left = max(floor, left)
            self._buckets[key] = (left, now)
            self._buckets.move_to_end(key)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
            return left


class FailureThrottle:
    """Thread-safe: used from the event loop and from worker threads."""

    def __init__(self, config: ThrottleConfig = ThrottleConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        if config.burst < 1 or config.per_second <= 0:
            raise ValueError("a throttle needs burst >= 1 and per_second > 0")
        self.config = config
        self._buckets = TokenBuckets(float(config.burst), config.per_second, config.max_clients, clock)

    def __len__(self) -> int:
        """Client addresses remembered now."""
        return len(self._buckets)

    def retry_after(self, client: str) -> float:
        """0 when `client` may try now; else the seconds until its next attempt."""
        tokens = self._buckets.level(client)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.config.per_second

    def failed(self, client: str) -> None:
        """Spend one attempt of `client`'s allowance."""
        self._buckets.take(client, 1.0)


def client_address(request: Request) -> str | None:
    """The caller's address: uvicorn puts a trusted proxy's X-Forwarded-For here."""
    return request.client.host if request.client else None
