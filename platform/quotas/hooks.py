"""Quota admission for one gateway process: a reservation against the tenant's and its
key's limits when a request is admitted, its settlement by the tokens used when it ends.

Per request, for a tenant (and key) without limits: one cache lookup, no database work.
With limits: one transaction at admission (counters + lease), one at settlement (lease +
counters). Work that must outlive a request cancelled meanwhile (giving back what an
admission took as its client left, retrying a settlement that failed) is handed to a
`Background` runner: one that retries an idempotent operation until it succeeds (the
usage writer's thread, which also retries settlements replayed from the usage journal).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from loraplex.platform.errors import MeteringUnavailableError, RateLimitedError
from loraplex.platform.quotas.admission import Charges, Reservation, plan_admission
from loraplex.platform.quotas.cache import QuotaCache
from loraplex.platform.quotas.dialects import open_quota_store
from loraplex.platform.quotas.limits import key_scope, tenant_scope
from loraplex.platform.quotas.store import quota_engine
from loraplex.platform.serving.hooks import RequestContext
from loraplex.platform.settings import QuotaConfig

log = logging.getLogger(__name__)

# Runs an idempotent database operation off the request, retrying it until it succeeds.
Background = Callable[[Callable[[], None]], None]


class QuotaHooks:
    """Quota reservations for one gateway process, kept in `RequestContext.hook_state`."""

    def __init__(self, config: QuotaConfig, db_url: str, holder: str, background: Background) -> None:
        # Its own engine, no pre-ping (a round trip per checkout): errors are retried instead.
        self.quota_engine = quota_engine(db_url)
        self.limits = QuotaCache(self.quota_engine, config.cache_ttl)
        # SQLite takes one writer at a time: one quota thread queues them without lock waits.
        self.store = open_quota_store(self.quota_engine, holder, config.lease_ttl,
                                      threads=4 if self.quota_engine.dialect.name == "postgresql" else 1)
        self.background = background
        self.rejections: dict[str, int] = {}  # limit kind -> requests refused (429)

    async def admit(self, ctx: RequestContext) -> None:
        """Reserve what the request may use (RateLimitedError: a limit is full), or nothing
        when no limit applies; MeteringUnavailableError when the limits or the counters
        cannot be read (refused rather than served unlimited)."""
        p = ctx.principal
        try:
            limits = await self.limits.get(p.tenant_id)
        except Exception as exc:  # no limits known, none readable: refuse rather than serve unlimited
            log.warning("reading the quotas of tenant %s failed: %s: %s", p.tenant, type(exc).__name__, exc)
            raise MeteringUnavailableError("quota accounting is unavailable; retry shortly") from None
        if limits.empty:
            return
        scopes = []
        if limits.tenant is not None:
            scopes.append((tenant_scope(p.tenant_id), f"tenant {p.tenant}", limits.tenant))
        key = limits.keys.get(p.key_id)
        if key is not None:
            scopes.append((key_scope(p.key_id), f"API key lpx_{p.key_prefix}", key))
        if scopes:
            ctx.hook_state = await self._reserve(ctx, scopes)

    async def _reserve(self, ctx: RequestContext, scopes: list) -> Reservation:
        now = time.time()
        try:
            checks = plan_admission(scopes, ctx.num_prompt_tokens + ctx.max_tokens, now)
            return await self._completing(self.store.start_reserve(ctx.request_id, checks, now),
                                          undo=lambda res: self.store.settle(res, 0))
        except RateLimitedError as exc:
            kind = getattr(exc, "limit", "other")
            self.rejections[kind] = self.rejections.get(kind, 0) + 1
            raise
        except Exception as exc:  # the quota database is unreachable: refuse, do not serve unmetered
            log.warning("quota admission failed: %s: %s", type(exc).__name__, exc)
            raise MeteringUnavailableError("quota accounting is unavailable; retry shortly") from None

    @staticmethod
    def charges(ctx: RequestContext) -> Charges | None:
        """What the request holds and has not settled yet (None: nothing)."""
        res = ctx.hook_state
        return res.charges if isinstance(res, Reservation) and res.leased and not res.settled else None

    async def settle(self, ctx: RequestContext, used: int, *, settled: Callable[[], None],
                     retry: Background) -> None:
        """Settle the request's reservation by the `used` tokens; `settled()` once it went
        through here, else `retry` gets the settlement to retry (it never raises but for
        cancellation)."""
        res = ctx.hook_state

        def again() -> None:
            retry(lambda: self.store.settle(res, used))

        try:
            await self._completing(self.store.start_settle(res, used), retry=again)
            settled()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - retried in the background
            log.warning("settling the quota of %s failed (%s); retrying in the background", ctx.request_id, exc)
            again()

    async def _completing(self, fut: asyncio.Future, undo: Callable | None = None,
                          retry: Callable | None = None) -> Any:
        """Await `fut`, which runs to its end even if this request is cancelled meanwhile;
        then `undo(result)` runs on success (admission: give it back) or `retry()` on
        failure (settlement: retried in the background)."""
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            def after(f: asyncio.Future) -> None:
                if f.cancelled():
                    return  # never ran: nothing to undo
                if f.exception() is None:
                    if undo is not None:
                        result = f.result()
                        self.background(lambda: undo(result))
                elif retry is not None:
                    retry()

            fut.add_done_callback(after)
            raise

    # -- leases ---------------------------------------------------------------------------
    @property
    def lease_ttl(self) -> float:
        return self.store.lease_ttl

    def leased(self, contexts: Iterable[RequestContext]) -> list[str]:
        """The ids of those requests that hold a lease still to settle (to renew)."""
        return [c.request_id for c in contexts if self.charges(c) is not None]

    def renew(self, request_ids: list[str]) -> None:
        """Blocking: extend these leases by the lease TTL."""
        self.store.renew(request_ids)

    def reap(self) -> None:
        """Blocking: give back the reservations of other (dead) processes' expired leases."""
        self.store.reap()

    # -- lifecycle, metrics ---------------------------------------------------------------
    async def close(self) -> None:
        await self.store.aclose()
        await asyncio.to_thread(self.store.close)
        self.quota_engine.dispose()

    def invalidate(self, tenant_id: int | None = None) -> None:
        """Forget cached limits after a quota change made in this process."""
        self.limits.invalidate(tenant_id)

    def collect(self):
        """The quota series (a Prometheus collector, read at scrape time)."""
        from prometheus_client.core import CounterMetricFamily

        rej = CounterMetricFamily("loraplex:quota_rejections", "Requests refused (429) by a quota, by limit.",
                                  labels=["limit"])
        for kind in ("rpm", "tpm", "conc", "budget"):
            rej.add_metric([kind], self.rejections.get(kind, 0))
        yield rej
