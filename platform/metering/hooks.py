"""Metering for one gateway process: a checkpoint of a running request's usage when one
is due, its usage event when it ends.

Per request: a journal append at finish (its fsync shared with every request finishing
meanwhile: group commit), and a checkpoint while it runs (ledger.py); no database work on
the request's path. The events then go through the batched writer (writer.py). The quota
charges a request holds are journalled with its events, so a crash loses neither; the
quotas themselves (quotas/hooks.py) are settled by whoever composes the two
(assembly/usage_hooks.py), between `record` and `acknowledge`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from loraplex.engine.output import RequestOutput

from loraplex.platform.db.database import database_id, make_db_engine
from loraplex.platform.errors import MeteringUnavailableError
from loraplex.platform.metering.journal import Journal, JournalError
from loraplex.platform.metering.ledger import JournalConfig, Ledger
from loraplex.platform.metering.writer import STATUS, Event, UsageWriter
from loraplex.platform.quotas.admission import Charges, Reservation
from loraplex.platform.serving.hooks import RequestContext
from loraplex.platform.settings import UsageConfig

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


@dataclass(frozen=True)
class Recorded:
    """A finished request's usage event, journalled (`lsn`) and queued for the database;
    `segment` stays pinned for its quota settlement. Both None: the journal failed and
    the event went to the database writer only."""

    event: Event
    lsn: int | None
    segment: int | None


class MeteringHooks:
    """The usage journal, ledger and batched writer of one gateway process."""

    def __init__(self, config: UsageConfig, journal: JournalConfig, db_url: str, holder: str,
                 settle: Callable[[Reservation, int], None]) -> None:
        # Its own engine, no pre-ping (a round trip per checkout): errors are retried instead.
        self.writer_engine = make_db_engine(db_url, pre_ping=False, pool_size=1, max_overflow=1)
        self.journal_config = journal
        self.journal = Journal(journal.directory, holder, journal.max_segment_bytes)
        self.writer = UsageWriter(self.writer_engine, batch_size=config.batch_size, flush_interval=config.flush_seconds,
                                  max_buffer=config.max_buffer, close_timeout=config.drain_seconds, journal=self.journal)
        # `settle`: a quota settlement replayed from a dead process's journal.
        self.ledger = Ledger(self.journal, self.writer, settle, self.journal_config)
        self._open: dict[str, RequestContext] = {}  # admitted, not finished

    async def start(self) -> None:
        """Bind the journal to the database its events go to, then claim the journals of
        dead processes of the same database."""
        self.journal.bind(await asyncio.to_thread(database_id, self.writer_engine))
        self.writer.start()
        await asyncio.to_thread(self.ledger.recover)

    async def close(self) -> None:
        """Flush the usage writer; what the database did not take stays in the journal for
        the next start."""
        await asyncio.to_thread(self.writer.close)
        await asyncio.to_thread(self.journal.close)

    def dispose(self) -> None:
        self.writer_engine.dispose()

    # -- a request ------------------------------------------------------------------------
    def check_admitting(self) -> None:
        """MeteringUnavailableError (503) when a new request's usage could not be recorded."""
        if self.journal.error is not None:
            raise MeteringUnavailableError("usage cannot be recorded durably (the usage journal's disk failed); "
                                           "retry on another replica")
        if self.writer.overloaded:
            raise MeteringUnavailableError("usage metering is behind (database unavailable?); retry shortly")

    def opened(self, ctx: RequestContext) -> None:
        """The request was admitted: it is metered from now on."""
        self._open[ctx.request_id] = ctx

    def progress(self, ctx: RequestContext, out: RequestOutput,
                 charges: Callable[[RequestContext], Charges | None]) -> Awaitable[None] | None:
        """Record the prompt tokens the engine processed; checkpoint (with the request's
        `charges`) when one is due (the output waits for it). See ledger.py for the bound
        this gives."""
        ctx.num_processed_prompt_tokens = max(ctx.num_processed_prompt_tokens, out.num_processed_prompt_tokens)
        if not out.new_token_ids or ctx.request_id not in self._open:
            return None
        now = time.monotonic()
        if not self.ledger.due(ctx.request_id, ctx.num_output_tokens, now):
            return None
        try:
            lsn = self.ledger.checkpoint(checkpoint_of(ctx, out, time.time()), charges(ctx), now)
        except JournalError:
            return None  # admission refuses new requests; this one's final event still goes to the database
        return self.journal.durable(lsn)

    def record(self, ctx: RequestContext, charges: Charges | None) -> Recorded | None:
        """Journal the request's usage event with the quota `charges` still to settle, and
        queue it for the database; None when the request is not open here (not admitted
        here, or already finished). Never raises."""
        if self._open.pop(ctx.request_id, None) is None:
            return None
        try:
            event = event_of(ctx)
        except Exception:  # finish must not raise
            log.exception("building the usage event of %s failed", ctx.request_id)
            self.ledger.forget(ctx.request_id)
            return None
        try:
            lsn, seg = self.ledger.finish(event, charges)
        except JournalError:
            lsn, seg = None, None
            self.ledger.forget(ctx.request_id)
            self.writer.submit(event)
        return Recorded(event, lsn, seg)

    def settled(self, rec: Recorded) -> None:
        """The request's quota settlement went through: its journal segment may go."""
        if rec.segment is not None:
            self.ledger.settled(rec.segment)

    def retry(self, rec: Recorded, op: Callable[[], None]) -> None:
        """Retry the request's quota settlement `op` on the writer thread until it succeeds."""
        self.writer.submit_op(op, rec.segment)

    async def acknowledge(self, rec: Recorded, request_id: str) -> None:
        """Return once the event survives a crash (its journal record is durable)."""
        if rec.lsn is None:
            return
        try:
            await self.journal.durable(rec.lsn)
        except JournalError:
            log.error("the usage event of %s is not durable (journal failed); it is queued for the database",
                      request_id)

    # -- for the composition, tests and metrics --------------------------------------------
    def open_contexts(self) -> list[RequestContext]:
        return list(self._open.values())

    @property
    def open_requests(self) -> int:
        return len(self._open)

    def collect(self):
        """The metering series (a Prometheus collector, read at scrape time)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        h, w = self, self.writer
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
