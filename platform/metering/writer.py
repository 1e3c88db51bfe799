"""Metering: one usage event per request, written by a batched background writer.

Durability comes first from the usage journal (journal.py, driven by hooks.py): an event
is fsync'd there before its request is acknowledged, and stays there until this writer
has committed it to the database.

The writer owns a thread. `submit()` (called on the event loop, costs a deque append)
never blocks and never drops: the buffer is bounded by refusing NEW requests (503) once
`backlog()` passes `max_buffer`, while events of requests already running are always
taken. The thread writes batches of up to `batch_size` events every `flush_interval`
seconds (or as soon as a batch is full), in one transaction per batch:

  1. INSERT the events ... ON CONFLICT (request_id) DO NOTHING RETURNING request_id
  2. add exactly the rows that were inserted to the hourly rollups (sorted upserts)

so a batch retried after an ambiguous failure (the commit went through, its answer did
not) writes no event twice and counts none twice in the rollups. On a database error
the same batch is retried with exponential backoff (up to `max_backoff` seconds) until
it goes through. At close (server shutdown) the buffer is flushed; whatever the database
still refuses after `close_timeout` stays in the journal and is replayed (idempotently)
at the next start.
"""
from __future__ import annotations

import collections
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine, select

from loraplex.platform.db.usage_tables import BASE_ADAPTER_ID, UsageAdapter, UsageEvent, UsageHourly
from loraplex.platform.metering.journal import Journal

log = logging.getLogger(__name__)

# Gateway finish reasons -> the event's status.
STATUS = {"stop": "stop", "length": "length", "abort": "aborted", "aborted": "aborted", "error": "error",
          "timeout": "timeout"}
STATUSES = ("stop", "length", "aborted", "error", "timeout")


@dataclass(slots=True)
class Event:
    """One request's usage. Token counts are what is billed: prompt (and cached) tokens
    count once the engine produced output for the request (its prefill ran); completion
    tokens are every token the engine handed the gateway, delivered to the client or not."""

    request_id: str
    tenant_id: int
    key_id: int | None
    adapter: str | None
    adapter_digest: str | None
    lane: int
    status: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    received_at: float  # unix seconds
    first_token_at: float | None
    finished_at: float
    correlation_id: str | None = None  # the HTTP request's x-request-id

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def _utc(t: float | None) -> dt.datetime | None:
    return None if t is None else dt.datetime.fromtimestamp(t, dt.timezone.utc)


def _insert(engine: Engine):
    if engine.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert


_EVENT_COLUMNS = ("request_id", "tenant_id", "key_id", "adapter_id", "lane", "status", "prompt_tokens",
                  "cached_tokens", "completion_tokens", "received_at", "first_token_at", "finished_at",
                  "correlation_id")
_EVENT_TYPES = ("text", "int", "int", "int", "smallint", "text", "int", "int", "int", "timestamptz", "timestamptz",
                "timestamptz", "text")
_PG_EVENTS = (f"INSERT INTO usage_events ({', '.join(_EVENT_COLUMNS)}) SELECT * FROM unnest("
              + ", ".join(f"%({c})s::{t}[]" for c, t in zip(_EVENT_COLUMNS, _EVENT_TYPES))
              + ") ON CONFLICT (request_id) DO NOTHING RETURNING request_id")
_ROLLUP_SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "aborted", "errors")
_PG_ROLLUP = ("INSERT INTO usage_hourly (tenant_id, hour, adapter_id, " + ", ".join(_ROLLUP_SUMS) + ") "
              "SELECT * FROM unnest(%(t)s::int[], %(h)s::timestamptz[], %(a)s::int[], "
              + ", ".join(f"%(v{i})s::bigint[]" for i in range(len(_ROLLUP_SUMS)))
              + ") ON CONFLICT (tenant_id, hour, adapter_id) DO UPDATE SET "
              + ", ".join(f"{c} = usage_hourly.{c} + excluded.{c}" for c in _ROLLUP_SUMS))


class EventStore:
    """Writes batches of events idempotently, with their rollups, in one transaction."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._insert = _insert(engine)
        self._adapter_ids: dict[tuple[str, str], int] = {}
        ins = self._insert(UsageHourly)
        ex = ins.excluded
        self._rollup = ins.on_conflict_do_update(
            index_elements=["tenant_id", "hour", "adapter_id"],
            set_={c: getattr(UsageHourly, c) + getattr(ex, c)
                  for c in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "aborted", "errors")})
        self._events = (self._insert(UsageEvent).on_conflict_do_nothing(index_elements=["request_id"])
                        .returning(UsageEvent.request_id))
        self.pg = engine.dialect.name == "postgresql"

    @staticmethod
    def _insert_events_pg(conn, rows: list[dict]) -> list[str]:
        """PostgreSQL: one INSERT ... SELECT FROM unnest(arrays): a short statement however
        many rows (a VALUES list of thousands of parameters costs more to build and parse)."""
        params = {c: [r[c] for r in rows] for c in _EVENT_COLUMNS}
        return [r[0] for r in conn.exec_driver_sql(_PG_EVENTS, params).fetchall()]

    def _adapter_id(self, conn, name: str | None, digest: str | None) -> int:
        if name is None:
            return BASE_ADAPTER_ID
        key = (name, digest or "")
        aid = self._adapter_ids.get(key)
        if aid is None:
            conn.execute(self._insert(UsageAdapter).values(name=key[0], digest=key[1]).on_conflict_do_nothing())
            aid = conn.execute(select(UsageAdapter.id).where(UsageAdapter.name == key[0],
                                                             UsageAdapter.digest == key[1])).scalar_one()
        return aid

    def write(self, events: list[Event]) -> int:
        """Write `events`; returns how many were new (the rest were written before)."""
        if not events:
            return 0
        ids: dict[tuple[str, str], int] = {}
        with self.engine.begin() as conn:
            rows = []
            for e in events:
                aid = self._adapter_id(conn, e.adapter, e.adapter_digest)
                if e.adapter is not None:
                    ids[(e.adapter, e.adapter_digest or "")] = aid
                rows.append({"request_id": e.request_id, "tenant_id": e.tenant_id, "key_id": e.key_id,
                             "adapter_id": aid, "lane": e.lane, "status": e.status,
                             "prompt_tokens": e.prompt_tokens, "cached_tokens": e.cached_tokens,
                             "completion_tokens": e.completion_tokens, "received_at": _utc(e.received_at),
                             "first_token_at": _utc(e.first_token_at), "finished_at": _utc(e.finished_at),
                             "correlation_id": e.correlation_id})
            inserted = set(self._insert_events_pg(conn, rows) if self.pg else conn.execute(self._events, rows).scalars())
            sums: dict[tuple[int, int, int], list[int]] = {}
            for e, row in zip(events, rows):
                if e.request_id not in inserted:
                    continue
                inserted.discard(e.request_id)  # a duplicate inside one batch counts once
                k = (e.tenant_id, int(e.finished_at // 3600) * 3600, row["adapter_id"])
                s = sums.setdefault(k, [0, 0, 0, 0, 0, 0])
                s[0] += 1
                s[1] += e.prompt_tokens
                s[2] += e.cached_tokens
                s[3] += e.completion_tokens
                s[4] += e.status == "aborted"
                s[5] += e.status == "error"
            if sums and self.pg:
                keys = sorted(sums)
                cols = list(zip(*(sums[k] for k in keys)))
                conn.exec_driver_sql(_PG_ROLLUP, {
                    "t": [k[0] for k in keys], "h": [_utc(k[1]) for k in keys], "a": [k[2] for k in keys],
                    **{f"v{i}": list(col) for i, col in enumerate(cols)}})
            elif sums:
                conn.execute(self._rollup, [
                    {"tenant_id": t, "hour": _utc(h), "adapter_id": a, "requests": s[0], "prompt_tokens": s[1],
                     "cached_tokens": s[2], "completion_tokens": s[3], "aborted": s[4], "errors": s[5]}
                    for (t, h, a), s in sorted(sums.items())])
            new = sum(s[0] for s in sums.values())
        self._adapter_ids.update(ids)  # only ids of committed rows are remembered
        return new


class UsageWriter:
    """Writes events to the database in batches from its own thread.

    With a `journal`, an event is submitted together with the journal segment its record
    is in (pinned by the caller); the writer unpins it once the event is committed, so
    the journal keeps every event until the database has it. An idempotent operation
    (a quota settlement) is retried the same way and unpins its segment when it succeeds.
    """

    def __init__(self, engine: Engine, *, batch_size: int = 500, flush_interval: float = 0.25,
                 max_buffer: int = 100_000, max_backoff: float = 5.0, close_timeout: float = 10.0,
                 journal: Journal | None = None) -> None:
        self.store = EventStore(engine)
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.max_buffer = max_buffer
        self.max_backoff = max_backoff
        self.close_timeout = close_timeout
        self.journal = journal
        self._q: collections.deque[tuple[Event, int | None]] = collections.deque()
        self._ops: collections.deque[tuple[Callable[[], None], int | None]] = collections.deque()
        self._batch: list[tuple[Event, int | None]] = []  # taken from the queue, not yet committed
        self._cond = threading.Condition()
        self._stop = False
        self._deadline = float("inf")
        self._thread: threading.Thread | None = None
        # Counters for metrics and tests.
        self.written = 0  # events inserted
        self.duplicates = 0  # events already present (a retry after an ambiguous commit, a replay)
        self.failures = 0  # failed batch attempts
        self.left_in_journal = 0  # events the database had not taken at close (replayed at the next start)

    # -- producer side (event loop) -------------------------------------------------
    def submit(self, event: Event, segment: int | None = None) -> None:
        """Queue `event` for the database; `segment` (a journal segment pinned for it) is
        unpinned once it is committed. Never blocks, never drops."""
        self._q.append((event, segment))  # deque.append is atomic
        if len(self._q) >= self.batch_size:
            with self._cond:
                self._cond.notify()

    def submit_op(self, op: Callable[[], None], segment: int | None = None) -> None:
        """An idempotent database operation to retry in the writer thread (a quota settlement
        that failed inline); `segment` is unpinned when it succeeds."""
        self._ops.append((op, segment))
        with self._cond:
            self._cond.notify()

    def backlog(self) -> int:
        return len(self._q) + len(self._batch)

    @property
    def overloaded(self) -> bool:
        return self.backlog() >= self.max_buffer

    def _unpin(self, segment: int | None) -> None:
        if segment is not None and self.journal is not None:
            self.journal.unpin(segment)

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="loraplex-usage-writer", daemon=True)
            self._thread.start()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything submitted so far is written (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while self.backlog() or self._ops:
            with self._cond:
                self._cond.notify()
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Flush and stop. What the database would not take within `timeout` stays in the
        journal (replayed at the next start); without a journal it is lost, loudly."""
        timeout = self.close_timeout if timeout is None else timeout
        with self._cond:
            self._stop = True
            self._deadline = time.monotonic() + timeout
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout + 5)
            self._thread = None
        left = self.backlog()
        if left and self.journal is None:
            log.error("usage writer: %d usage events could not be written and there is no journal: LOST", left)
        elif left:
            self.left_in_journal += left
            log.warning("usage writer: %d usage events left in the journal %s (replayed at the next start)",
                        left, self.journal.dir)

    # -- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.05
        while True:
            with self._cond:  # wait for a full batch, the flush interval, work to retry or stop
                if not self._stop and not self._batch and not self._ops and len(self._q) < self.batch_size:
                    self._cond.wait(self.flush_interval)
            if not self._batch:
                n = min(self.batch_size, len(self._q))
                self._batch = [self._q.popleft() for _ in range(n)]
            if not self._batch and not self._ops and self._stop:
                return
            failed = self._run_ops()
            try:
                if self._batch:
                    new = self.store.write([e for e, _seg in self._batch])
                    self.written += new
                    self.duplicates += len(self._batch) - new
                    for _e, seg in self._batch:
                        self._unpin(seg)
                    self._batch = []
            except Exception as exc:  # noqa: BLE001 - keep the batch, retry with backoff
                failed = exc
            if failed is None:
                backoff = 0.05
                continue
            self.failures += 1
            if self._stop and time.monotonic() >= self._deadline:
                log.error("usage writer: database still failing at shutdown (%s)", failed)
                return
            log.warning("usage writer: writing %d events failed (%s: %s); retrying in %.2f s",
                        len(self._batch), type(failed).__name__, failed, backoff)
            with self._cond:
                self._cond.wait(min(backoff, max(0.0, self._deadline - time.monotonic())))
            backoff = min(self.max_backoff, backoff * 2)

    def _run_ops(self) -> Exception | None:
        try:
            while self._ops:
                op, seg = self._ops[0]
                op()
                self._ops.popleft()
                self._unpin(seg)
        except Exception as exc:  # noqa: BLE001 - kept and retried; events go on meanwhile
            return exc
        return None
