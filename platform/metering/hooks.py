"""The gateway's admission/metering hooks: quotas at admission, a usage event and a
quota settlement at finish. `create_app` builds one per app unless hooks are passed in.

Per request, for a tenant (and key) without limits: one cache lookup at admission and a
journal append at finish (its fsync shared with every request finishing meanwhile: group
commit), no database work. With limits: one transaction at admission (counters + lease),
one at finish (lease + counters). Usage events are journalled (ledger.py) and then go
through the batched writer (writer.py).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from loraplex.engine.output import RequestOutput

from loraplex.platform.db.database import make_db_engine
from loraplex.platform.errors import MeteringUnavailableError, RateLimitedError
from loraplex.platform.serving.hooks import Hooks, RequestContext
from loraplex.platform.metering.journal import Journal, JournalError
from loraplex.platform.metering.ledger import JournalConfig, Ledger
from loraplex.platform.metering.writer import STATUS, Event, UsageWriter
from loraplex.platform.quotas.admission import Reservation, plan_admission
from loraplex.platform.quotas.cache import QuotaCache
from loraplex.platform.quotas.limits import key_scope, tenant_scope
from loraplex.platform.quotas.dialects import open_quota_store
from loraplex.platform.quotas.store import quota_engine
from loraplex.platform.settings import Settings

log = logging.getLogger(__name__)


def billed_tokens(ctx: RequestContext) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens billed for a finished request: the prompt tokens
    the engine processed (all of them once it produced output; those of the prefill chunks
    that ran for a request aborted before its first token), every completion token the
    engine produced for it (delivered to the client or not)."""
    if ctx.num_output_tokens > 0:
        return ctx.num_prompt_tokens, ctx.num_cached_tokens, ctx.num_output_tokens
    return ctx.num_processed_prompt_tokens, min(ctx.num_cached_tokens, ctx.num_processed_prompt_tokens), 0


def event_of(ctx: RequestContext) -> Event:
    prompt, cached, completion = billed_tokens(ctx)
    p = ctx.principal
    return Event(ctx.request_id, p.tenant_id, p.key_id, ctx.adapter, ctx.adapter_digest, int(ctx.lane),
                 STATUS.get(ctx.finish_reason or "abort", "error"), prompt, cached, completion, ctx.received_at,
                 ctx.first_token_at, ctx.finished_at or time.time(), ctx.correlation_id)


def checkpoint_of(ctx: RequestContext, out: RequestOutput, now: float) -> Event:
    """The event a crash right now would bill: the prompt the engine processed, the
    completion tokens already handed on (not `out`'s), status error."""
    p = ctx.principal
    prompt = max(out.num_processed_prompt_tokens, ctx.num_processed_prompt_tokens)
    return Event(ctx.request_id, p.tenant_id, p.key_id, ctx.adapter, ctx.adapter_digest, int(ctx.lane), "error",
                 prompt, min(out.num_cached_tokens, prompt), ctx.num_output_tokens, ctx.received_at,
                 ctx.first_token_at or (time.time() if ctx.num_output_tokens else None), now, ctx.correlation_id)


def _charges(ctx: RequestContext) -> list | None:
    res = ctx.hook_state
    return res.charges if isinstance(res, Reservation) and res.leased and not res.settled else None


class UsageHooks(Hooks):
    """Quotas + metering for one gateway process."""

    def __init__(self, settings: Settings, db_url: str | None = None, journal: JournalConfig | None = None) -> None:
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
        self.journal_config = journal or JournalConfig(settings.data_dir / "usage-journal")
        self.journal = Journal(self.journal_config.directory, self.holder, self.journal_config.max_segment_bytes)
        self.writer = UsageWriter(self.writer_engine, batch_size=settings.usage_batch_size,
                                  flush_interval=settings.usage_flush_seconds, max_buffer=settings.usage_max_buffer,
                                  close_timeout=settings.usage_drain_seconds, journal=self.journal)
        self.ledger = Ledger(self.journal, self.writer, self.store.settle, self.journal_config)
        self._open: dict[str, RequestContext] = {}  # admitted, not finished
        self._maintenance: asyncio.Task | None = None
        self.rejections: dict[str, int] = {}  # limit kind -> requests refused (429)

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self.writer.start()
        await asyncio.to_thread(self.ledger.recover)
        if self._maintenance is None:
            self._maintenance = asyncio.create_task(self._maintain())

    async def close(self, grace: float = 5.0) -> None:
        """At shutdown: let requests the server cancelled finish (up to `grace` s), finish the
        rest as aborted, then flush the usage writer; what the database did not take stays
        in the journal for the next start."""
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
        await asyncio.to_thread(self.journal.close)
        await self.store.aclose()
        await asyncio.to_thread(self.store.close)
        self.quota_engine.dispose()
        self.writer_engine.dispose()

    async def _maintain(self) -> None:
        """Renew the leases of this process's live requests; reap other (dead) processes'
        expired ones and recover their usage journals. A lease whose request is gone here is
        not renewed: if its settlement was lost, it expires and a reaper gives its
        reservation back."""
        ttl = self.store.lease_ttl
        renew_every = max(0.05, ttl / 3)
        reap_every = max(0.1, ttl / 2)
        next_reap = time.monotonic() + random.uniform(0, reap_every)
        while True:
            await asyncio.sleep(renew_every)
            try:
                live = [rid for rid, c in self._open.items() if isinstance(c.hook_state, Reservation)
                        and c.hook_state.leased and not c.hook_state.settled]
                if live:
                    await asyncio.to_thread(self.store.renew, live)
                if time.monotonic() >= next_reap:
                    next_reap = time.monotonic() + reap_every
                    await asyncio.to_thread(self.store.reap)
                    # A sibling process on this data dir that died meanwhile: its journal now.
                    await asyncio.to_thread(self.ledger.recover)
            except Exception:  # a DB hiccup: the next round retries
                log.exception("quota lease maintenance failed")

    # -- the hooks --------------------------------------------------------------------------
    async def admit(self, ctx: RequestContext) -> None:
        if self.journal.error is not None:
            raise MeteringUnavailableError("usage cannot be recorded durably (the usage journal's disk failed); "
                                           "retry on another replica")
        if self.writer.overloaded:
            raise MeteringUnavailableError("usage metering is behind (database unavailable?); retry shortly")
        p = ctx.principal
        try:
            limits = await self.limits.get(p.tenant_id)
        except Exception as exc:  # no limits known, none readable: refuse rather than serve unlimited
            log.warning("reading the quotas of tenant %s failed: %s: %s", p.tenant, type(exc).__name__, exc)
            raise MeteringUnavailableError("quota accounting is unavailable; retry shortly") from None
        if not limits.empty:
            scopes = []
            if limits.tenant is not None:
                scopes.append((tenant_scope(p.tenant_id), f"tenant {p.tenant}", limits.tenant))
            key = limits.keys.get(p.key_id)
            if key is not None:
                scopes.append((key_scope(p.key_id), f"API key lpx_{p.key_prefix}", key))
            if scopes:
                ctx.hook_state = await self._reserve(ctx, scopes)
        self._open[ctx.request_id] = ctx

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

    def progress(self, ctx: RequestContext, out: RequestOutput) -> Awaitable[None] | None:
        """Record the prompt tokens the engine processed; checkpoint when one is due (the
        output waits for it). See ledger.py for the bound this gives."""
        ctx.num_processed_prompt_tokens = max(ctx.num_processed_prompt_tokens, out.num_processed_prompt_tokens)
        if not out.new_token_ids or ctx.request_id not in self._open:
            return None
        now = time.monotonic()
        if not self.ledger.due(ctx.request_id, ctx.num_output_tokens, now):
            return None
        try:
            lsn = self.ledger.checkpoint(checkpoint_of(ctx, out, time.time()), _charges(ctx), now)
        except JournalError:
            return None  # admission refuses new requests; this one's final event still goes to the database
        return self.journal.durable(lsn)

    async def finish(self, ctx: RequestContext) -> None:
        if self._open.pop(ctx.request_id, None) is None:
            return  # not admitted here, or already finished (close() at shutdown)
        try:
            event = event_of(ctx)
        except Exception:  # finish must not raise
            log.exception("building the usage event of %s failed", ctx.request_id)
            self.ledger.forget(ctx.request_id)
            return
        res = ctx.hook_state
        charges = _charges(ctx)
        try:
            lsn, seg = self.ledger.finish(event, charges)  # first: the event is never lost, whatever follows
        except JournalError:
            lsn, seg = None, None
            self.ledger.forget(ctx.request_id)
            self.writer.submit(event)
        if charges is not None:
            used = event.total_tokens
            settled = (lambda: self.ledger.settled(seg)) if seg is not None else (lambda: None)

            def retry() -> None:
                self.writer.submit_op(lambda: self.store.settle(res, used), seg)

            try:
                await self._completing(self.store.start_settle(res, used), retry=retry)
                settled()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - retried by the writer thread
                log.warning("settling the quota of %s failed (%s); retrying in the background",
                            ctx.request_id, exc)
                retry()
        if lsn is not None:
            try:
                await self.journal.durable(lsn)  # the acknowledgement: the event survives a crash now
            except JournalError:
                log.error("the usage event of %s is not durable (journal failed); it is queued for the database",
                          ctx.request_id)

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
        yield CounterMetricFamily("loraplex:usage_journal_fsyncs", "Group commits (fsyncs) of the usage journal.",
                                  value=h.journal.fsyncs)
        yield CounterMetricFamily("loraplex:usage_checkpoints", "In-flight usage checkpoints journalled.",
                                  value=h.ledger.checkpoints)
        yield CounterMetricFamily("loraplex:usage_events_recovered",
                                  "Usage events recovered from the journals of stopped processes.",
                                  value=h.ledger.recovered)
        yield CounterMetricFamily("loraplex:usage_journal_skipped_bytes",
                                  "Damaged usage journal bytes skipped at recovery (the records around them kept).",
                                  value=h.ledger.skipped_bytes)
        yield CounterMetricFamily("loraplex:usage_journal_skipped_records",
                                  "Usage journal records lost to damage at recovery.", value=h.ledger.skipped_records)
