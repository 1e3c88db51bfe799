"""The database side of quotas for one gateway process: one `QuotaStore` per SQL dialect,
chosen once by `open_quota_store`."""
from __future__ import annotations

import abc
import asyncio
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import Engine, delete, event, text, update

from loraplex.platform.db.database import make_db_engine
from loraplex.platform.db.usage_tables import QuotaCounter, QuotaLease
from loraplex.platform.errors import RateLimitedError
from loraplex.platform.quotas.admission import Check, Reservation, charges_of
from loraplex.platform.quotas.windows import minute_start

log = logging.getLogger(__name__)

Move = tuple[str, str, int, int]  # (scope, kind, window_start, delta)

REAP = text("UPDATE quota_leases SET state = 'reaped' WHERE state = 'live' AND expires_at < :now "
            "RETURNING request_id, charges")
_MOVE_SQL: dict[int, str] = {}


def counter_values(n: int) -> str:
    return ", ".join(f"(:s{i}, :k{i}, :w{i}, :u{i}, :l{i})" for i in range(n))


def move_sql(n: int) -> str:
    """Unconditional counter moves of `n` rows (settle, release) in one sorted upsert."""
    sql = _MOVE_SQL.get(n)
    if sql is None:
        sql = _MOVE_SQL[n] = (
            f"INSERT INTO quota_counters (scope, kind, window_start, used, lim) VALUES {counter_values(n)} "
            "ON CONFLICT (scope, kind, window_start) DO UPDATE SET used = quota_counters.used + excluded.used")
    return sql


def counter_params(rows: list[tuple[str, str, int, int, int]]) -> dict:
    p = {}
    for i, (s, k, w, u, lim) in enumerate(rows):
        p[f"s{i}"], p[f"k{i}"], p[f"w{i}"], p[f"u{i}"], p[f"l{i}"] = s, k, w, u, lim
    return p


def move_rows(moves: list[Move]) -> list[tuple[str, str, int, int, int]]:
    return sorted((s, k, w, d, 0) for s, k, w, d in moves if d != 0)


def is_disconnect(exc: BaseException) -> bool:
    """Worth one retry on a fresh connection: a dropped/stale connection, a deadlock."""
    import sqlite3

    import psycopg

    if isinstance(exc, sqlite3.ProgrammingError):  # a closed connection
        return True
    return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))


def quota_engine(url: str, pool_size: int = 4) -> Engine:
    """The engine quotas run on: no pre-ping (a stale connection is replaced and the
    operation retried instead), and commits that do not wait for a disk flush (SQLite
    synchronous=NORMAL in WAL mode, PostgreSQL synchronous_commit=off): a database
    crash may lose the last milliseconds of counter changes, never their consistency.
    Usage events (billing) keep fully durable commits on their own engine."""
    engine = make_db_engine(url, pre_ping=False, pool_size=pool_size, max_overflow=pool_size,
                            sqlite_synchronous="NORMAL")
    if engine.dialect.name == "postgresql":
        def _async_commit(dbapi_conn, _record) -> None:
            autocommit = dbapi_conn.autocommit
            dbapi_conn.autocommit = True
            dbapi_conn.execute("SET synchronous_commit TO off")
            dbapi_conn.autocommit = autocommit

        event.listen(engine, "connect", _async_commit)
    return engine


class QuotaStore(abc.ABC):
    """The counters and leases of one gateway process (`holder`).

    Contract: `reserve` takes every counter in its checks or none and raises
    RateLimitedError naming the limit; `settle` gives back what admission took, keeping
    the tokens actually used, exactly once (a repeated settlement does nothing).
    `start_reserve` / `start_settle` do the same as futures that complete even if their
    awaiter is cancelled. The hot path bypasses SQLAlchemy's pool: each synchronous
    caller thread holds one raw connection; a connection that fails is dropped and the
    operation retried once on a fresh one. Maintenance (`renew`, `reap`) goes through
    SQLAlchemy transactions and is the same on every dialect.
    """

    def __init__(self, engine: Engine, holder: str, lease_ttl: float = 60.0, threads: int = 4) -> None:
        self.engine = engine
        self.holder = holder
        self.lease_ttl = lease_ttl
        self.threads = threads
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="loraplex-quota")
        self._local = threading.local()
        self._conns: list = []
        self._lock = threading.Lock()

    @abc.abstractmethod
    def reserve(self, request_id: str, checks: list[Check], now: float) -> Reservation: ...

    @abc.abstractmethod
    def settle(self, res: Reservation, tokens_used: int) -> None: ...

    @abc.abstractmethod
    def start_reserve(self, request_id: str, checks: list[Check], now: float) -> asyncio.Future: ...

    @abc.abstractmethod
    def start_settle(self, res: Reservation, tokens_used: int) -> asyncio.Future: ...

    @abc.abstractmethod
    def _prepare(self, raw) -> None:
        """Put a fresh raw DBAPI connection in the mode the hot path expects."""

    async def aclose(self) -> None:
        """Close what the event loop holds (PostgreSQL's async pool)."""

    # -- raw connections ----------------------------------------------------------------
    def _conn(self):
        fairy = getattr(self._local, "conn", None)
        if fairy is None:
            fairy = self.engine.raw_connection()
            self._prepare(fairy.driver_connection)
            self._local.conn = fairy
            with self._lock:
                self._conns.append(fairy)
        return fairy.driver_connection

    def _drop_conn(self) -> None:
        fairy = getattr(self._local, "conn", None)
        self._local.conn = None
        if fairy is not None:
            with self._lock:
                if fairy in self._conns:
                    self._conns.remove(fairy)
            try:
                fairy.invalidate()
            except Exception:  # noqa: BLE001 - already broken
                pass

    def _with_retry(self, op):
        for attempt in (0, 1):
            try:
                return op(self._conn())
            except RateLimitedError:
                raise
            except Exception as exc:
                if attempt or not is_disconnect(exc):
                    self._after_failure()
                    raise
                self._drop_conn()  # a stale or broken connection: one retry on a fresh one

    def _after_failure(self) -> None:
        """Leave this thread's connection usable after an operation failed."""

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        with self._lock:
            conns, self._conns = self._conns, []
        for fairy in conns:
            try:
                fairy.invalidate()  # autocommit connections must not go back to the pool
            except Exception:  # noqa: BLE001
                pass

    def _reserve_params(self, request_id: str, checks: list[Check], now: float) -> tuple[dict, list]:
        rows = [(c.scope, c.kind, c.window, c.amount, c.limit) for c in checks]
        charges = [(c.scope, c.kind, c.window, c.amount) for c in checks if c.kind != "rpm"]
        params = counter_params(rows)
        params["n"] = len(rows)
        if charges:
            params.update(r=request_id, h=self.holder, e=int(now + self.lease_ttl),
                          c=json.dumps([list(c) for c in charges]))
        return params, charges

    @staticmethod
    def _done() -> asyncio.Future:
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    # -- maintenance --------------------------------------------------------------------------
    def renew(self, request_ids: list[str], now: float | None = None) -> int:
        """Extend the leases of these requests, live in this process (the heartbeat). Only
        these: a lease of this holder whose request is gone (its settlement lost) expires."""
        now = time.time() if now is None else now
        n = 0
        with self.engine.begin() as conn:
            for i in range(0, len(request_ids), 500):
                n += conn.execute(update(QuotaLease).where(
                    QuotaLease.holder == self.holder, QuotaLease.state == "live",
                    QuotaLease.request_id.in_(sorted(request_ids[i:i + 500]))
                ).values(expires_at=int(now + self.lease_ttl))).rowcount
        return n

    def reap(self, now: float | None = None) -> int:
        """Give back the reservations of expired leases (their holder died or hung), and
        drop counters and lease tombstones nobody needs any more. Returns leases reaped."""
        now = time.time() if now is None else now
        with self.engine.begin() as conn:
            reaped = conn.execute(REAP, {"now": int(now)}).all()
            rows = move_rows([(s, k, w, -a) for _rid, charges in reaped for s, k, w, a in charges_of(charges)])
            if rows:
                conn.execute(text(move_sql(len(rows))), counter_params(rows))
        if reaped:
            log.warning("released the reservations of %d expired quota lease(s)", len(reaped))
        with self.engine.begin() as conn:
            conn.execute(delete(QuotaCounter).where(QuotaCounter.kind.in_(("rpm", "tpm")),
                                                    QuotaCounter.window_start < minute_start(now) - 120))
            conn.execute(delete(QuotaCounter).where(QuotaCounter.kind == "budget",
                                                    QuotaCounter.window_start < now - 63 * 86400))
            conn.execute(delete(QuotaLease).where(QuotaLease.state == "reaped",
                                                  QuotaLease.expires_at < now - 86400))
        return len(reaped)
