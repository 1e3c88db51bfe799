"""The gateway's admission/metering hooks: quotas at admission, a usage event and a
quota settlement at finish. `create_app` builds one per app unless hooks are passed in.

Per request, for a tenant (and key) without limits: one cache lookup at admission and a
deque append at finish, no database work. With limits: one transaction at admission
(counters + lease), one at finish (lease + counters). Usage events always go through
the batched writer (metering/writer.py).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

from loraplex.platform.db.database import make_db_engine
from loraplex.platform.errors import MeteringUnavailableError, RateLimitedError
from loraplex.platform.serving.gateway import RequestContext
from loraplex.platform.metering.writer import STATUS, Event, UsageWriter
from loraplex.platform.quotas.admission import Reservation, plan_admission
from loraplex.platform.quotas.cache import QuotaCache
from loraplex.platform.quotas.limits import key_scope, tenant_scope
from loraplex.platform.quotas.dialects import open_quota_store
from loraplex.platform.quotas.store import quota_engine
from loraplex.platform.settings import Settings

log = logging.getLogger(__name__)


def billed_tokens(ctx: RequestContext) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens billed for a finished request: prompt tokens
    once the engine produced output (the prefill ran), every completion token the engine
    produced for it (delivered to the client or not)."""
    done = ctx.num_output_tokens > 0
    return (ctx.num_prompt_tokens if done else 0, ctx.num_cached_tokens if done else 0, ctx.num_output_tokens)


def event_of(ctx: RequestContext) -> Event:
    prompt, cached, completion = billed_tokens(ctx)
    p = ctx.principal
    return Event(ctx.request_id, p.tenant_id, p.key_id, ctx.adapter, ctx.adapter_digest, int(ctx.lane),
                 STATUS.get(ctx.finish_reason or "abort", "error"), prompt, cached, completion, ctx.received_at,
                 ctx.first_token_at, ctx.finished_at or time.time(), ctx.correlation_id)


class UsageHooks:
    """Quotas + metering for one gateway process."""

    def __init__(self, settings: Settings, db_url: str | None = None) -> None:
        url = db_url or settings.db_url
        self.settings = settings
        self.holder = uuid.uuid4().hex[:16]
        # Own engines, no pre-ping (a round trip per checkout): errors are retried instead.
        self.quota_engine = quota_engine(url)
        self.writer_engine = make_db_engine(url, pre_ping=False, pool_size=1, max_overflow=1)
        self.limits = QuotaCache(self.quota_engine, settings.quota_cache_ttl)
        # SQLite takes one writer at a time: one quota thread queues them without lock waits.
        self.store = open_quota_store(self.quota_engine, self.holder, settings.quota_lease_ttl,
                                      threads=4 if self.quota_engine.dialect.name == "postgresql" else 1)
        self.writer = UsageWriter(self.writer_engine, batch_size=settings.usage_batch_size,
                                  flush_interval=settings.usage_flush_seconds, max_buffer=settings.usage_max_buffer,
                                  spool_dir=settings.data_dir / "usage-spool")
        self._open: dict[str, RequestContext] = {}  # admitted, not finished
        self._maintenance: asyncio.Task | None = None
        self.rejections: dict[str, int] = {}  # limit kind -> requests refused (429)

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self.writer.start()
        if self._maintenance is None:
            self._maintenance = asyncio.create_task(self._maintain())

    async def close(self, grace: float = 5.0) -> None:
        """At shutdown: let requests the server cancelled finish (up to `grace` s), finish the
        rest as aborted, then flush the usage writer."""
        deadline = time.monotonic() + grace
        while self._open and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for ctx in list(self._open.values()):
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
        await asyncio.to_thread(self.writer.close)
        await self.store.aclose()
        await asyncio.to_thread(self.store.close)
        self.quota_engine.dispose()
        self.writer_engine.dispose()

    async def _maintain(self) -> None:
        """Renew this process's quota leases; reap other (dead) processes' expired ones."""
        ttl = self.store.lease_ttl
        renew_every = max(0.05, ttl / 3)
        reap_every = max(0.1, ttl / 2)
        next_reap = time.monotonic() + random.uniform(0, reap_every)
        while True:
            await asyncio.sleep(renew_every)
            try:
                if any(isinstance(c.hook_state, Reservation) and c.hook_state.leased for c in self._open.values()):
                    await asyncio.to_thread(self.store.renew)
                if time.monotonic() >= next_reap:
                    next_reap = time.monotonic() + reap_every
                    await asyncio.to_thread(self.store.reap)
            except Exception:  # a DB hiccup: the next round retries
                log.exception("quota lease maintenance failed")

    # -- the hooks --------------------------------------------------------------------------
    async def admit(self, ctx: RequestContext) -> None:
        if self.writer.overloaded:
            raise MeteringUnavailableError("usage metering is behind (database unavailable?); retry shortly")
        p = ctx.principal
        limits = await self.limits.get(p.tenant_id)
        if not limits.empty:
            scopes = []
            if limits.tenant is not None:
                scopes.append((tenant_scope(p.tenant_id), f"tenant {p.tenant}", limits.tenant))
            key = limits.keys.get(p.key_id)
            if key is not None:
                scopes.append((key_scope(p.key_id), f"API key lpx_{p.key_prefix}", key))
            if scopes:
                now = time.time()
                try:
                    checks = plan_admission(scopes, ctx.num_prompt_tokens + ctx.max_tokens, now)
                except RateLimitedError as exc:
                    kind = getattr(exc, "limit", "other")
                    self.rejections[kind] = self.rejections.get(kind, 0) + 1
                    raise
                try:
                    ctx.hook_state = await self._completing(self.store.start_reserve(ctx.request_id, checks, now),
                                                            undo=lambda res: self.store.settle(res, 0))
                except RateLimitedError as exc:
                    kind = getattr(exc, "limit", "other")
                    self.rejections[kind] = self.rejections.get(kind, 0) + 1
                    raise
                except Exception as exc:  # the quota database is unreachable: refuse, do not serve unmetered
                    log.warning("quota admission failed: %s: %s", type(exc).__name__, exc)
                    raise MeteringUnavailableError("quota accounting is unavailable; retry shortly") from None
        self._open[ctx.request_id] = ctx

    async def finish(self, ctx: RequestContext) -> None:
        if self._open.pop(ctx.request_id, None) is None:
            return  # not admitted here, or already finished (close() at shutdown)
        try:
            event = event_of(ctx)
        except Exception:  # finish must not raise
            log.exception("building the usage event of %s failed", ctx.request_id)
            return
        self.writer.submit(event)  # first: the event is never lost, whatever follows
        res = ctx.hook_state
        if isinstance(res, Reservation) and res.leased:
            used = event.total_tokens
            try:
                await self._completing(self.store.start_settle(res, used),
                                       retry=lambda: self.writer.submit_op(lambda: self.store.settle(res, used)))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - retried by the writer thread
                log.warning("settling the quota of %s failed (%s); retrying in the background",
                            ctx.request_id, exc)
                self.writer.submit_op(lambda: self.store.settle(res, used))

    async def _completing(self, fut: asyncio.Future, undo: Callable | None = None,
                          retry: Callable | None = None) -> Any:
        """Await `fut`, which runs to its end even if this request is cancelled meanwhile;
        then `undo(result)` runs on success (admission: give it back) or `retry()` on
        failure (settlement: the writer thread retries it)."""
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            def after(f: asyncio.Future) -> None:
                if f.cancelled():
                    return  # never ran: nothing to undo
                if f.exception() is None:
                    if undo is not None:
                        result = f.result()
                        self.writer.submit_op(lambda: undo(result))
                elif retry is not None:
                    retry()

            fut.add_done_callback(after)
            raise

    # -- for tests, metrics and the admin API ---------------------------------------------
    def register_metrics(self, registry) -> None:
        """Quota and metering series on the app's Prometheus registry (read at scrape time)."""
        registry.register(_UsageCollector(self))

    @property
    def open_requests(self) -> int:
        return len(self._open)

    def invalidate(self, tenant_id: int | None = None) -> None:
        """Forget cached limits after a quota change made in this process."""
        self.limits.invalidate(tenant_id)


class _UsageCollector:
    def __init__(self, hooks: UsageHooks) -> None:
        self.h = hooks

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        h, w = self.h, self.h.writer
        rej = CounterMetricFamily("loraplex:quota_rejections", "Requests refused (429) by a quota, by limit.",
                                  labels=["limit"])
        for kind in ("rpm", "tpm", "conc", "budget"):
            rej.add_metric([kind], h.rejections.get(kind, 0))
        yield rej
        yield GaugeMetricFamily("loraplex:metered_requests_in_flight", "Admitted requests not finished yet.",
                                value=h.open_requests)
        yield GaugeMetricFamily("loraplex:usage_events_pending", "Usage events not yet written to the database.",
                                value=w.backlog())
        yield CounterMetricFamily("loraplex:usage_events_written", "Usage events written.", value=w.written)
        yield CounterMetricFamily("loraplex:usage_write_failures", "Failed usage batch writes (retried).",
                                  value=w.failures)
        yield CounterMetricFamily("loraplex:usage_events_spooled", "Usage events spooled to disk at shutdown.",
                                  value=w.spooled)
