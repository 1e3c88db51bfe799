"""The gateway's hooks when none are passed in: quotas (quotas/hooks.py) and metering
(metering/hooks.py) composed, in the one order that keeps both crash-safe.

- admit: metering must be able to record the request (else 503), then the quota
  reservation (429 when a limit is full), then the request is metered.
- finish: the usage event is journalled with the quota charges still held, first, so it
  is never lost whatever follows; then the quota is settled (a failed settlement is
  retried on the usage writer's thread, and the journal keeps its segment until it went
  through); then the request is acknowledged once its event is durable.
- maintenance: the leases of this process's live requests are renewed every
  `lease_ttl / 3`; every `lease_ttl / 2` other (dead) processes' expired leases are
  reaped and their usage journals recovered. A lease whose request is gone here is not
  renewed: if its settlement was lost, it expires and a reaper gives its reservation back.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid

from loraplex.engine.output import RequestOutput

from loraplex.platform.metering.hooks import MeteringHooks
from loraplex.platform.metering.ledger import JournalConfig
from loraplex.platform.quotas.hooks import QuotaHooks
from loraplex.platform.serving.hooks import Hooks, RequestContext
from loraplex.platform.settings import Settings

log = logging.getLogger(__name__)


class UsageHooks(Hooks):
    """Quotas + metering for one gateway process."""

    def __init__(self, settings: Settings, db_url: str | None = None, journal: JournalConfig | None = None) -> None:
        url = db_url or settings.db_url
        self.holder = uuid.uuid4().hex[:16]  # this process: its quota leases and its usage journal
        # Quota work that outlives a request runs on the usage writer's thread, which
        # retries it as it retries settlements replayed from the journal.
        self.quotas = QuotaHooks(settings.quotas, url, self.holder, lambda op: self.metering.writer.submit_op(op))
        self.metering = MeteringHooks(settings.usage, journal or JournalConfig(settings.data_dir / "usage-journal"),
                                      url, self.holder, self.quotas.store.settle)
        self._maintenance: asyncio.Task | None = None

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        await self.metering.start()
        if self._maintenance is None:
            self._maintenance = asyncio.create_task(self._maintain())

    async def close(self, grace: float = 5.0) -> None:
        """At shutdown: let requests the server cancelled finish (up to `grace` s), finish the
        rest as aborted, then flush the usage writer; what the database did not take stays
        in the journal for the next start."""
        deadline = time.monotonic() + grace
        while self.metering.open_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for ctx in self.metering.open_contexts():
            log.warning("request %s still open at shutdown: metered as aborted", ctx.request_id)
            ctx.finish_reason = ctx.finish_reason or "abort"
            ctx.finished_at = ctx.finished_at or time.time()
            await self.finish(ctx)
        if self._maintenance is not None:
            self._maintenance.cancel()
            try:
                await self._maintenance
            except BaseException:  # noqa: BLE001 - cancelled
                pass
            self._maintenance = None
        await self.metering.close()  # its last settlement retries still use the quota store
        await self.quotas.close()
        self.metering.dispose()

    async def _maintain(self) -> None:
        ttl = self.quotas.lease_ttl
        renew_every = max(0.05, ttl / 3)
        reap_every = max(0.1, ttl / 2)
        next_reap = time.monotonic() + random.uniform(0, reap_every)
        while True:
            await asyncio.sleep(renew_every)
            try:
                live = self.quotas.leased(self.metering.open_contexts())
                if live:
                    await asyncio.to_thread(self.quotas.renew, live)
                if time.monotonic() >= next_reap:
                    next_reap = time.monotonic() + reap_every
                    await asyncio.to_thread(self.quotas.reap)
                    # A sibling process on this data dir that died meanwhile: its journal now.
                    await asyncio.to_thread(self.metering.ledger.recover)
            except Exception:  # a DB hiccup: the next round retries
                log.exception("quota lease maintenance failed")

    # -- the hooks --------------------------------------------------------------------------
    async def admit(self, ctx: RequestContext) -> None:
        self.metering.check_admitting()
        await self.quotas.admit(ctx)
        self.metering.opened(ctx)

    def progress(self, ctx: RequestContext, out: RequestOutput):
        return self.metering.progress(ctx, out, self.quotas.charges)

    async def finish(self, ctx: RequestContext) -> None:
        charges = self.quotas.charges(ctx)
        rec = self.metering.record(ctx, charges)  # first: the event is never lost, whatever follows
        if rec is None:
            return  # not admitted here, or already finished (close() at shutdown)
        if charges is not None:
            await self.quotas.settle(ctx, rec.event.total_tokens, settled=lambda: self.metering.settled(rec),
                                     retry=lambda op: self.metering.retry(rec, op))
        await self.metering.acknowledge(rec, ctx.request_id)

    def register_metrics(self, registry) -> None:
        """Quota and metering series on the app's Prometheus registry (read at scrape time)."""
        registry.register(self.quotas)
        registry.register(self.metering)

    def quotas_changed(self, tenant_id: int | None = None) -> None:
        self.quotas.invalidate(tenant_id)

    @property
    def open_requests(self) -> int:
        return self.metering.open_requests
