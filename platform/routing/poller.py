"""The thin asyncio loop around the pool: re-resolve membership, poll each worker's stats.

The probe (the transport's stats call) is injected: `probe(url)` returns the worker's
`WorkerStats` or raises; a probe that fails or outlives `health_timeout_s` counts as a
failed health check. All decisions stay in the pool and fleet.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from loraplex.platform.routing.discovery import Discovery
from loraplex.platform.routing.errors import DiscoveryError
from loraplex.platform.routing.pool import WorkerPool
from loraplex.platform.routing.view import WorkerStats

log = logging.getLogger(__name__)

Probe = Callable[[str], Awaitable[WorkerStats]]


class HealthPoller:
    def __init__(self, pool: WorkerPool, discovery: Discovery, probe: Probe) -> None:
        self.pool, self.discovery, self.probe = pool, discovery, probe
        self._resolved_at: float | None = None

    async def refresh_members(self) -> None:
        """Resolve membership now; on failure keep the last one (a DNS blip empties no pool)."""
        try:
            urls = await asyncio.to_thread(self.discovery.resolve)
        except DiscoveryError as exc:
            log.warning("worker discovery failed, keeping %d workers: %s",
                        len(self.pool.fleet.members), exc)
            return
        finally:
            self._resolved_at = time.monotonic()
        added, removed = self.pool.set_members(urls)
        if added or removed:
            log.info("workers joined %s, left %s", added, removed)

    async def check(self, url: str) -> None:
        try:
            stats = await asyncio.wait_for(self.probe(url), self.pool.config.health_timeout_s)
        except Exception as exc:  # whatever the transport raises, the worker failed this check
            log.debug("health check of %s failed: %r", url, exc)
            stats = None
        self.pool.record_health(url, stats)

    async def poll_once(self) -> None:
        """Re-resolve if `dns_interval_s` passed, then check every member concurrently."""
        interval = self.pool.config.dns_interval_s
        if self._resolved_at is None or time.monotonic() - self._resolved_at >= interval:
            await self.refresh_members()
        await asyncio.gather(*(self.check(url) for url in self.pool.fleet.members))

    async def run(self) -> None:
        """Poll forever, every `health_interval_s`; cancel the task to stop."""
        while True:
            await self.poll_once()
            await asyncio.sleep(self.pool.config.health_interval_s)
