"""Failed admin authentications in the audit log, aggregated per window.

A flood of failed sign-ins or wrong Bearer tokens from many addresses must not become a
flood of audit rows (each a database write). Per action, the first failure of a window gets
its row at once (a lone mistake is visible immediately); every later one in the window is
counted, and the window ends with one row: how many, from how many addresses, a sample of
them, the last reason. Memory per window is bounded (MAX_DISTINCT addresses counted).

Attempts refused with 429 because their address failed too often are failures too, counted
in the same window (and how many of the count they were): a throttled flood is the one an
operator most needs to see, and it must not become a row per attempt either.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

WINDOW_SECONDS = 60.0
SAMPLE = 10  # addresses named in an aggregated row
MAX_DISTINCT = 10_000  # past it the count of addresses reads "at least"

Writer = Callable[[str, str, str, dict[str, Any]], Awaitable[None]]  # (actor, action, target, details)


@dataclass
class _Window:
    started: float
    count: int = 0  # failures after the first
    throttled: int = 0  # of those, attempts refused because the address was throttled
    clients: set[str] = field(default_factory=set)
    reason: str = ""


class FailureAudit:
    """Call `failed()` from the event loop; `close()` writes the windows still open."""

    def __init__(self, write: Writer, window: float = WINDOW_SECONDS) -> None:
        self._write = write
        self.window = window
        self._open: dict[str, _Window] = {}
        self._tasks: set[asyncio.Task] = set()
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def failed(self, action: str, client: str | None, reason: str, *, throttled: bool = False) -> None:
        """One refused attempt; `throttled` when it was refused (429) without its credential
        being checked, because its address failed too often lately."""
        who = client or "unknown"
        w = self._open.get(action)
        if w is None:
            self._open[action] = _Window(time.time())
            self._timers[action] = asyncio.get_running_loop().call_later(self.window, self._close, action)
            self._spawn(action, f"client:{who}", {"reason": reason})
            return
        w.count += 1
        w.throttled += throttled
        w.reason = reason
        if len(w.clients) < MAX_DISTINCT:
            w.clients.add(who)

    def _close(self, action: str) -> None:
        self._timers.pop(action, None)
        w = self._open.pop(action, None)
        if w is None or not w.count:
            return
        n = len(w.clients)
        target = f"client:{next(iter(w.clients))}" if n == 1 else f"clients:{n}{'+' if n >= MAX_DISTINCT else ''}"
        self._spawn(action, target, {"count": w.count, "throttled": w.throttled, "distinct_clients": n,
                                     "clients": sorted(w.clients)[:SAMPLE], "since": w.started,
                                     "window_seconds": self.window, "reason": w.reason})

    def _spawn(self, action: str, target: str, details: dict[str, Any]) -> None:
        task = asyncio.get_running_loop().create_task(self._guarded(action, target, details))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guarded(self, action: str, target: str, details: dict[str, Any]) -> None:
        try:
            await self._write("anonymous", action, target, details)
        except Exception:  # noqa: BLE001 - an audit write must not fail the request that was refused
            log.exception("writing the audit row for %s failed", action)

    async def close(self) -> None:
        for action in list(self._open):
            timer = self._timers.pop(action, None)
            if timer is not None:
                timer.cancel()
            self._close(action)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
