"""Refusals cost their sender time, not the server CPU: every 429 the app answers is held
`ServerLimits.refusal_hold` seconds (never past its Retry-After) before it is sent.

A client that floods requests it is refused (unknown keys past the failed-authentication
throttle, bodies over its tenant's byte budget, a tenant over its quotas) gets one answer
per connection per hold, and its connections are capped per address: what answering it
costs the server stays bounded whatever rate it sends at. A held answer is a timer on the
event loop, nothing more. The per-address connection cap's own 429 (listener.py) is
written by the protocol and never held: the connection it refuses is not counted."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class RefusalHold:
    """ASGI middleware holding 429 answers; the app's gateway metrics show how many are held."""

    def __init__(self, app: ASGIApp, hold: float, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.app, self.hold, self.sleep = app, hold, sleep

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.hold <= 0:
            await self.app(scope, receive, send)
            return

        async def held(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 429:
                await self._wait(scope, _retry_after(message))
            await send(message)

        await self.app(scope, receive, held)

    async def _wait(self, scope: Scope, retry_after: float) -> None:
        gateway = getattr(scope["app"].state, "gateway", None)
        gauge = gateway.metrics.refusals_held if gateway is not None else None
        if gauge is not None:
            gauge.inc()
        try:
            await self.sleep(min(self.hold, retry_after))
        finally:
            if gauge is not None:
                gauge.dec()


def _retry_after(message: Message) -> float:
    for name, value in message.get("headers", ()):
        if name.lower() == b"retry-after":
            try:
                return max(0.0, float(value))
            except ValueError:
                break
    return 1.0
