"""Quotas: requests per minute, tokens per minute, concurrent requests and a token budget
per day or month, per tenant and optionally per API key.

Enforcement lives in the database, so every gateway process sharing it enforces ONE limit:

- Admission is one transaction: a single multi-row conditional upsert on
  `quota_counters` (`used = used + n WHERE used + n <= limit`, RETURNING the rows it
  changed) for every limit that applies, plus one lease row when the request holds
  something to give back (a concurrency slot, a token reservation). Any row missing from
  RETURNING means that limit is full: the transaction rolls back, nothing was taken.
  Tokens reserved = prompt tokens + max_tokens, against the budget and the token rate.
- Settlement is one transaction: delete the lease, then move each counter by
  (tokens actually used - tokens reserved) and give the concurrency slot back. A lease
  already gone means it was settled before (a retried settlement does nothing).
- A gateway that dies leaves live leases behind. Holders renew their leases every
  `lease_ttl / 3`; any replica's reaper marks expired ones `reaped` and gives their
  reservations back. If the request finishes after all, settlement finds `reaped` and
  charges the tokens actually used (the reservation is already back).
- Rows are always upserted in one sorted order, so concurrent transactions on PostgreSQL
  lock them in the same order and cannot deadlock each other.

Windows are fixed: the UTC minute for rpm/tpm (a burst straddling a minute boundary can
see up to twice the rate over those two minutes, never more than the limit within one),
the UTC day or calendar month for budgets. Reservations count in the window where they
were admitted. Replicas must have synchronized clocks (NTP), as they compute windows.

The limits themselves are read through a per-process cache (`QuotaCache`, TTL
`Settings.quota_cache_ttl`, 5 s): a change made by the CLI or another replica applies
within that time. A tenant without limits costs no database work per request at all.
"""
from __future__ import annotations

import asyncio
import calendar
import collections
import datetime as dt
import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from sqlalchemy import Engine, delete, select, text

from .db import Database
from .errors import BadRequestError, NotFoundError, RateLimitedError
from .models import ApiKey, Tenant, utcnow
from .tenants import KEY_PREFIX, get_tenant
from .usage_models import Quota, QuotaCounter, QuotaLease

log = logging.getLogger(__name__)

PERIODS = ("day", "month")
LIMIT_FIELDS = ("rpm", "tpm", "max_concurrency", "token_budget", "budget_period")
LIMIT_NAMES = {"rpm": "requests-per-minute", "tpm": "tokens-per-minute", "conc": "max-concurrency",
               "budget": "token budget"}
UNSET: object = type("Unset", (), {"__repr__": lambda self: "UNSET"})()


# -- limits -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    token_budget: int | None = None
    budget_period: str | None = None  # day | month (set whenever token_budget is)

    @property
    def empty(self) -> bool:
        return self.rpm is None and self.tpm is None and self.max_concurrency is None and self.token_budget is None

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in LIMIT_FIELDS}


@dataclass(frozen=True)
class QuotaInfo:
    """The limits of a tenant (key_prefix None) or of one of its keys."""

    tenant: str
    key_prefix: str | None
    limits: Limits
    updated_at: dt.datetime | None

    def as_dict(self) -> dict:
        return {"tenant": self.tenant, "key_prefix": self.key_prefix, **self.limits.as_dict(),
                "updated_at": self.updated_at.isoformat() if self.updated_at else None}


def tenant_scope(tenant_id: int) -> str:
    return f"t:{tenant_id}"


def key_scope(key_id: int) -> str:
    return f"k:{key_id}"


def _check_limit(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequestError(f"{name} must be a whole number >= 0 (or none to clear it), got {value!r}", name)
    return value


def _resolve(s, tenant: str, key_prefix: str | None) -> tuple[Tenant, ApiKey | None]:
    t = get_tenant(s, tenant)
    if key_prefix is None:
        return t, None
    prefix = key_prefix.removeprefix(KEY_PREFIX).split("_")[0]
    k = s.scalars(select(ApiKey).where(ApiKey.prefix == prefix)).first()
    if k is None or k.tenant_id != t.id:
        raise NotFoundError(f"tenant {tenant!r} has no API key with prefix {prefix!r}")
    return t, k


def _row_limits(row: Quota | None) -> Limits:
    if row is None:
        return Limits()
    return Limits(row.rpm, row.tpm, row.max_concurrency, row.token_budget, row.budget_period)


def set_quota(db: Database, tenant: str, *, key_prefix: str | None = None, rpm=UNSET, tpm=UNSET,
              max_concurrency=UNSET, token_budget=UNSET, budget_period=UNSET) -> QuotaInfo:
    """Set (an int), clear (None) or keep (UNSET, the default) each limit of a tenant, or of
    one of its keys (`key_prefix`). A budget without a period gets "month". Clearing every
    limit deletes the row. Servers apply the change within their quota cache TTL."""
    new = {"rpm": rpm, "tpm": tpm, "max_concurrency": max_concurrency, "token_budget": token_budget,
           "budget_period": budget_period}
    for name in ("rpm", "tpm", "max_concurrency", "token_budget"):
        if new[name] is not UNSET:
            _check_limit(name, new[name])
    if budget_period is not UNSET and budget_period is not None and budget_period not in PERIODS:
        raise BadRequestError(f"budget_period must be day or month, got {budget_period!r}", "budget_period")
    with db.session() as s:
        t, k = _resolve(s, tenant, key_prefix)
        scope = key_scope(k.id) if k is not None else tenant_scope(t.id)
        row = s.scalars(select(Quota).where(Quota.scope == scope)).first()
        values = _row_limits(row).as_dict()
        values.update({n: v for n, v in new.items() if v is not UNSET})
        if values["token_budget"] is None:
            values["budget_period"] = None
        elif values["budget_period"] is None:
            values["budget_period"] = "month"
        limits = Limits(**values)
        if limits.empty:
            if row is not None:
                s.delete(row)
            return QuotaInfo(t.name, k.prefix if k else None, limits, None)
        if row is None:
            row = Quota(scope=scope, tenant_id=t.id, key_id=k.id if k else None)
            s.add(row)
        for n, v in values.items():
            setattr(row, n, v)
        row.updated_at = utcnow()
        return QuotaInfo(t.name, k.prefix if k else None, limits, row.updated_at)


def get_quota(db: Database, tenant: str, key_prefix: str | None = None) -> QuotaInfo:
    """The limits of a tenant or key (all None when it has none)."""
    with db.session() as s:
        t, k = _resolve(s, tenant, key_prefix)
        scope = key_scope(k.id) if k is not None else tenant_scope(t.id)
        row = s.scalars(select(Quota).where(Quota.scope == scope)).first()
        return QuotaInfo(t.name, k.prefix if k else None, _row_limits(row), row.updated_at if row else None)


def list_quotas(db: Database, tenant: str | None = None) -> list[QuotaInfo]:
    """Every quota row (tenant-wide first, then per key), optionally of one tenant."""
    q = (select(Quota, Tenant.name, ApiKey.prefix).join(Tenant, Tenant.id == Quota.tenant_id)
         .outerjoin(ApiKey, ApiKey.id == Quota.key_id).order_by(Tenant.name, Quota.key_id.is_not(None), ApiKey.prefix))
    with db.session() as s:
        if tenant is not None:
            q = q.where(Quota.tenant_id == get_tenant(s, tenant).id)
        return [QuotaInfo(name, prefix, _row_limits(row), row.updated_at) for row, name, prefix in s.execute(q)]


# -- windows ------------------------------------------------------------------------------
def minute_start(now: float) -> int:
    return int(now // 60) * 60


def period_bounds(period: str, now: float) -> tuple[int, int]:
    """(start, end) unix seconds of the UTC day or calendar month holding `now`."""
    if period == "day":
        start = int(now // 86400) * 86400
        return start, start + 86400
    d = dt.datetime.fromtimestamp(now, dt.timezone.utc)
    start = calendar.timegm((d.year, d.month, 1, 0, 0, 0))
    end = calendar.timegm((d.year + d.month // 12, d.month % 12 + 1, 1, 0, 0, 0))
    return start, end


# -- status for admins --------------------------------------------------------------------
@dataclass(frozen=True)
class QuotaStatus:
    """Where a tenant or key stands now against its limits (counters include reservations
    of requests in flight)."""

    quota: QuotaInfo
    requests_this_minute: int
    tokens_this_minute: int
    in_flight: int
    budget_used: int  # tokens used or reserved in the current budget period
    budget_period_start: dt.datetime | None
    budget_period_end: dt.datetime | None

    @property
    def budget_remaining(self) -> int | None:
        b = self.quota.limits.token_budget
        return None if b is None else max(0, b - self.budget_used)

    def as_dict(self) -> dict:
        iso = (lambda d: d.isoformat() if d else None)
        return {**self.quota.as_dict(), "requests_this_minute": self.requests_this_minute,
                "tokens_this_minute": self.tokens_this_minute, "in_flight": self.in_flight,
                "budget_used": self.budget_used, "budget_remaining": self.budget_remaining,
                "budget_period_start": iso(self.budget_period_start), "budget_period_end": iso(self.budget_period_end)}


def quota_status(db: Database, tenant: str, key_prefix: str | None = None, now: float | None = None) -> QuotaStatus:
    now = time.time() if now is None else now
    info = get_quota(db, tenant, key_prefix)
    with db.session() as s:
        t, k = _resolve(s, tenant, key_prefix)
        scope = key_scope(k.id) if k is not None else tenant_scope(t.id)
        rows = {(r.kind, r.window_start): r.used
                for r in s.scalars(select(QuotaCounter).where(QuotaCounter.scope == scope))}
    m = minute_start(now)
    start = end = None
    used = 0
    period = info.limits.budget_period
    if period:
        a, b = period_bounds(period, now)
        used = rows.get(("budget", a), 0)
        start, end = (dt.datetime.fromtimestamp(x, dt.timezone.utc) for x in (a, b))
    return QuotaStatus(info, rows.get(("rpm", m), 0), rows.get(("tpm", m), 0), rows.get(("conc", 0), 0), used,
                       start, end)


# -- the enforcement engine ---------------------------------------------------------------
@dataclass
class Reservation:
    """What one admitted request took; settled exactly once."""

    request_id: str
    # (scope, kind, window_start, amount) of everything to give back or settle (not rpm).
    charges: list[tuple[str, str, int, int]]
    leased: bool
    settled: bool = False


@dataclass
class _Check:
    scope: str
    label: str  # "tenant acme" / "key lpx_ab12..."
    kind: str
    window: int
    amount: int
    limit: int
    retry_after: float


def plan_admission(scopes: Iterable[tuple[str, str, Limits]], tokens: int, now: float) -> list[_Check]:
    """The counter changes admitting one request needs, or RateLimitedError right away
    when the request could never fit (more tokens than a whole limit, a zero limit)."""
    checks: list[_Check] = []
    m = minute_start(now)
    to_minute = m + 60 - now
    for scope, label, lim in scopes:
        if lim.rpm is not None:
            checks.append(_Check(scope, label, "rpm", m, 1, lim.rpm, to_minute))
        if lim.tpm is not None:
            checks.append(_Check(scope, label, "tpm", m, tokens, lim.tpm, to_minute))
        if lim.token_budget is not None:
            a, b = period_bounds(lim.budget_period or "month", now)
            checks.append(_Check(scope, label, "budget", a, tokens, lim.token_budget, b - now))
        if lim.max_concurrency is not None:
            checks.append(_Check(scope, label, "conc", 0, 1, lim.max_concurrency, 1.0))
    for c in checks:
        if c.amount > c.limit:
            if c.kind in ("tpm", "budget"):
                err = RateLimitedError(
                    f"{c.label}: this request needs up to {c.amount} tokens (prompt + max_tokens), more than its "
                    f"whole {LIMIT_NAMES[c.kind]} of {c.limit}; lower max_tokens", c.retry_after)
            else:
                err = RateLimitedError(f"{c.label} has a {LIMIT_NAMES[c.kind]} limit of {c.limit}", c.retry_after)
            err.limit = c.kind
            raise err
    checks.sort(key=lambda c: (c.scope, c.kind, c.window))
    return checks


def rejection(failed: list[_Check]) -> RateLimitedError:
    order = {"budget": 0, "conc": 1, "tpm": 2, "rpm": 3}
    worst = min(failed, key=lambda c: order[c.kind])
    retry = max(c.retry_after for c in failed)
    what = LIMIT_NAMES[worst.kind]
    if worst.kind == "budget":
        msg = f"{worst.label} has used its token budget of {worst.limit} for this period"
    elif worst.kind == "conc":
        msg = f"{worst.label} is at its max-concurrency limit of {worst.limit} requests in flight"
    else:
        msg = f"{worst.label} is over its {what} limit of {worst.limit}"
    err = RateLimitedError(f"{msg}; retry after {max(1, round(retry))} s", retry)
    err.limit = worst.kind  # for metrics
    return err


class _Sql:
    """Statement texts per number of rows, in SQLAlchemy/sqlite3 `:name` style (the SQLite
    hot path runs them on the raw sqlite3 connection; `move` also runs through SQLAlchemy)."""

    def __init__(self) -> None:
        self._admit: dict[int, str] = {}
        self._move: dict[int, str] = {}

    @staticmethod
    def _values(n: int) -> str:
        return ", ".join(f"(:s{i}, :k{i}, :w{i}, :u{i}, :l{i})" for i in range(n))

    def admit(self, n: int) -> str:
        sql = self._admit.get(n)
        if sql is None:
            sql = self._admit[n] = (
                f"INSERT INTO quota_counters (scope, kind, window_start, used, lim) VALUES {self._values(n)} "
                "ON CONFLICT (scope, kind, window_start) DO UPDATE SET used = quota_counters.used + excluded.used, "
                "lim = excluded.lim WHERE quota_counters.used + excluded.used <= excluded.lim "
                "RETURNING scope, kind")
        return sql

    def move(self, n: int) -> str:
        """Unconditional counter moves (settle, release): same sorted upsert shape."""
        sql = self._move.get(n)
        if sql is None:
            sql = self._move[n] = (
                f"INSERT INTO quota_counters (scope, kind, window_start, used, lim) VALUES {self._values(n)} "
                "ON CONFLICT (scope, kind, window_start) DO UPDATE SET used = quota_counters.used + excluded.used")
        return sql


class _PgSql:
    """PostgreSQL: admission and settlement are ONE autocommit statement each (one round
    trip, no BEGIN/COMMIT), with data-modifying CTEs. Admission divides by zero when any
    counter is full, which aborts the whole statement: all-or-nothing."""

    def __init__(self) -> None:
        self._reserve: dict[tuple[int, bool], str] = {}
        self._settle: dict[int, str] = {}

    def reserve(self, n: int, lease: bool) -> str:
        sql = self._reserve.get((n, lease))
        if sql is None:
            values = ", ".join(f"(%(s{i})s, %(k{i})s, %(w{i})s, %(u{i})s, %(l{i})s)" for i in range(n))
            sql = (f"WITH c AS (INSERT INTO quota_counters (scope, kind, window_start, used, lim) VALUES {values} "
                   "ON CONFLICT (scope, kind, window_start) DO UPDATE SET used = quota_counters.used + excluded.used, "
                   "lim = excluded.lim WHERE quota_counters.used + excluded.used <= excluded.lim RETURNING 1)")
            if lease:
                sql += (", l AS (INSERT INTO quota_leases (request_id, holder, state, expires_at, charges) "
                        "SELECT %(r)s, %(h)s, 'live', %(e)s, CAST(%(c)s AS JSON) "
                        "WHERE (SELECT count(*) FROM c) = %(n)s)")
            sql += " SELECT 1 / (CASE WHEN (SELECT count(*) FROM c) = %(n)s THEN 1 ELSE 0 END)"
            self._reserve[(n, lease)] = sql
        return sql

    def settle(self, n: int) -> str:
        sql = self._settle.get(n)
        if sql is None:
            values = ", ".join(f"(%(s{i})s, %(k{i})s, CAST(%(w{i})s AS BIGINT), CAST(%(dl{i})s AS BIGINT), "
                               f"CAST(%(dr{i})s AS BIGINT))" for i in range(n))
            sql = self._settle[n] = (
                "WITH l AS (DELETE FROM quota_leases WHERE request_id = %(r)s RETURNING state) "
                "INSERT INTO quota_counters (scope, kind, window_start, used, lim) "
                "SELECT v.s, v.k, v.w, CASE WHEN l.state = 'live' THEN v.dl ELSE v.dr END, 0 "
                f"FROM (VALUES {values}) AS v(s, k, w, dl, dr) CROSS JOIN l "
                "WHERE CASE WHEN l.state = 'live' THEN v.dl ELSE v.dr END <> 0 ORDER BY v.s, v.k, v.w "
                "ON CONFLICT (scope, kind, window_start) DO UPDATE SET used = quota_counters.used + excluded.used")
        return sql


_SQL = _Sql()
_PG = _PgSql()
_LITE_LEASE = ("INSERT INTO quota_leases (request_id, holder, state, expires_at, charges) "
               "VALUES (:r, :h, 'live', :e, :c)")
_LITE_TAKE = "DELETE FROM quota_leases WHERE request_id = :r RETURNING state"
_PG_PEEK = "SELECT scope, kind, window_start, used FROM quota_counters WHERE scope = ANY(%(scopes)s)"
_RENEW = text("UPDATE quota_leases SET expires_at = :e WHERE holder = :h AND state = 'live'")
_REAP = text("UPDATE quota_leases SET state = 'reaped' WHERE state = 'live' AND expires_at < :now "
             "RETURNING request_id, charges")


def _params(rows: list[tuple[str, str, int, int, int]]) -> dict:
    p = {}
    for i, (s, k, w, u, lim) in enumerate(rows):
        p[f"s{i}"], p[f"k{i}"], p[f"w{i}"], p[f"u{i}"], p[f"l{i}"] = s, k, w, u, lim
    return p


def _move_rows(moves: list[tuple[str, str, int, int]]) -> list[tuple[str, str, int, int, int]]:
    return sorted((s, k, w, d, 0) for s, k, w, d in moves if d != 0)


def _move(conn, moves: list[tuple[str, str, int, int]]) -> None:
    """Counter moves through a SQLAlchemy connection (maintenance)."""
    rows = _move_rows(moves)
    if rows:
        conn.execute(text(_SQL.move(len(rows))), _params(rows))


def _settle_moves(charges, tokens_used: int, live: bool) -> list[tuple[str, str, int, int]]:
    moves = []
    for scope, kind, window, amount in charges:
        if kind == "conc":
            if live:
                moves.append((scope, kind, window, -amount))
        else:  # tpm, budget: the reservation becomes the actual use
            moves.append((scope, kind, window, tokens_used - amount if live else tokens_used))
    return moves


def _is_disconnect(exc: BaseException) -> bool:
    """Worth one retry on a fresh connection: a dropped/stale connection, a deadlock."""
    import sqlite3

    if isinstance(exc, sqlite3.ProgrammingError):  # a closed connection
        return True
    try:
        import psycopg
    except ImportError:  # pragma: no cover - psycopg is a dependency
        return False
    return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))


def quota_engine(url: str, pool_size: int = 4) -> Engine:
    """The engine quotas run on: no pre-ping (a stale connection is replaced and the
    operation retried instead), and commits that do not wait for a disk flush (SQLite
    synchronous=NORMAL in WAL mode, PostgreSQL synchronous_commit=off): a database
    crash may lose the last milliseconds of counter changes, never their consistency.
    Usage events (billing) keep fully durable commits on their own engine."""
    from sqlalchemy import event

    from .db import make_db_engine

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


def _full(checks: list[_Check], used: dict) -> RateLimitedError:
    """The rejection when some counter was full; `used` read after the fact names which."""
    full = [c for c in checks if used.get((c.scope, c.kind, c.window), 0) + c.amount > c.limit]
    return rejection(full or checks)


class _AsyncPgPool:
    """A few psycopg AsyncConnections (autocommit, synchronous_commit off) for one loop."""

    def __init__(self, conninfo: str, size: int) -> None:
        self.conninfo = conninfo
        self.size = size
        self._idle: list = []
        self._count = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self):
        while True:
            if self._idle:
                return self._idle.pop()
            if self._count < self.size:
                self._count += 1
                try:
                    import psycopg

                    conn = await psycopg.AsyncConnection.connect(self.conninfo, autocommit=True)
                    await conn.execute("SET synchronous_commit TO off")
                    return conn
                except BaseException:
                    self._count -= 1
                    self._wake()
                    raise
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut

    def _wake(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    async def release(self, conn, broken: bool = False) -> None:
        if broken or conn.closed:
            self._count -= 1
            try:
                await conn.close()
            except Exception:  # noqa: BLE001 - already broken
                pass
        else:
            self._idle.append(conn)
        self._wake()

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            self._count -= 1
            await conn.close()


class QuotaStore:
    """The database side of quotas for one gateway process (`holder`).

    The hot path (`start_reserve`, `start_settle`) bypasses SQLAlchemy's pool and execution
    layer. PostgreSQL: one autocommit statement (one round trip) each, on psycopg async
    connections driven by the gateway's event loop (no thread hop). SQLite: one short
    `BEGIN IMMEDIATE` transaction each (the write lock first, so no lock upgrade can fail)
    on `executor`'s threads, each holding its own raw connection. A connection that fails
    is dropped and the operation retried once on a fresh one.
    Maintenance (`renew`, `reap`) goes through SQLAlchemy transactions.
    """

    def __init__(self, engine: Engine, holder: str, lease_ttl: float = 60.0, threads: int = 4) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.engine = engine
        self.holder = holder
        self.lease_ttl = lease_ttl
        self.pg = engine.dialect.name == "postgresql"
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="loraplex-quota")
        self.async_connections = threads
        self._apool: _AsyncPgPool | None = None
        self._local = threading.local()
        self._conns: list = []
        self._lock = threading.Lock()

    # -- raw connections ----------------------------------------------------------------
    def _conn(self):
        fairy = getattr(self._local, "conn", None)
        if fairy is None:
            fairy = self.engine.raw_connection()
            raw = fairy.driver_connection
            if self.pg:
                raw.autocommit = True
            else:
                raw.isolation_level = None  # explicit BEGIN IMMEDIATE / COMMIT
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
                if attempt or not _is_disconnect(exc):
                    if not self.pg:
                        self._rollback_quietly()
                    raise
                self._drop_conn()  # a stale or broken connection: one retry on a fresh one

    def _rollback_quietly(self) -> None:
        raw = getattr(self._local, "conn", None)
        if raw is not None and raw.driver_connection.in_transaction:
            try:
                raw.driver_connection.execute("ROLLBACK")
            except Exception:  # noqa: BLE001
                self._drop_conn()

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        with self._lock:
            conns, self._conns = self._conns, []
        for fairy in conns:
            try:
                fairy.invalidate()  # autocommit connections must not go back to the pool
            except Exception:  # noqa: BLE001
                pass

    # -- the hot path -----------------------------------------------------------------------
    def _reserve_params(self, request_id: str, checks: list[_Check], now: float) -> tuple[dict, list]:
        rows = [(c.scope, c.kind, c.window, c.amount, c.limit) for c in checks]
        charges = [(c.scope, c.kind, c.window, c.amount) for c in checks if c.kind != "rpm"]
        params = _params(rows)
        params["n"] = len(rows)
        if charges:
            params.update(r=request_id, h=self.holder, e=int(now + self.lease_ttl),
                          c=json.dumps([list(c) for c in charges]))
        return params, charges

    def reserve(self, request_id: str, checks: list[_Check], now: float) -> Reservation:
        """Take every counter in `checks` or none; raise RateLimitedError naming the limit.
        Synchronous (a quota thread, tests); the gateway uses start_reserve()."""
        params, charges = self._reserve_params(request_id, checks, now)
        if self.pg:
            self._with_retry(lambda conn: self._reserve_pg(conn, checks, params, bool(charges)))
        else:
            self._with_retry(lambda conn: self._reserve_lite(conn, checks, params, bool(charges)))
        return Reservation(request_id, charges, bool(charges))

    def start_reserve(self, request_id: str, checks: list[_Check], now: float) -> asyncio.Future:
        """reserve() as a future that completes even if its awaiter is cancelled: on
        PostgreSQL a task on this event loop (async driver, no thread hop), on SQLite a
        quota thread's job."""
        if not self.pg:
            return asyncio.wrap_future(self.executor.submit(self.reserve, request_id, checks, now))
        params, charges = self._reserve_params(request_id, checks, now)

        async def run() -> Reservation:
            await self._apg(lambda conn: self._areserve_pg(conn, checks, params, bool(charges)))
            return Reservation(request_id, charges, bool(charges))

        return asyncio.ensure_future(run())

    @staticmethod
    def _reserve_lite(conn, checks, params, lease: bool) -> None:
        conn.execute("BEGIN IMMEDIATE")
        got = set(conn.execute(_SQL.admit(len(checks)), params).fetchall())
        if len(got) < len(checks):
            conn.execute("ROLLBACK")
            raise rejection([c for c in checks if (c.scope, c.kind) not in got])
        if lease:
            conn.execute(_LITE_LEASE, params)
        conn.execute("COMMIT")

    @staticmethod
    def _reserve_pg(conn, checks, params, lease: bool) -> None:
        import psycopg

        try:
            conn.execute(_PG.reserve(len(checks), lease), params)
            return
        except psycopg.errors.DivisionByZero:  # some counter was full: the statement took nothing
            pass
        except psycopg.errors.UniqueViolation as exc:
            if exc.diag.table_name == "quota_leases":
                return  # a retry: the first attempt went through, only its answer was lost
            raise
        used = {(s, k, w): u for s, k, w, u in
                conn.execute(_PG_PEEK, {"scopes": sorted({c.scope for c in checks})}).fetchall()}
        raise _full(checks, used)

    @staticmethod
    async def _areserve_pg(conn, checks, params, lease: bool) -> None:
        import psycopg

        try:
            await conn.execute(_PG.reserve(len(checks), lease), params)
            return
        except psycopg.errors.DivisionByZero:
            pass
        except psycopg.errors.UniqueViolation as exc:
            if exc.diag.table_name == "quota_leases":
                return
            raise
        cur = await conn.execute(_PG_PEEK, {"scopes": sorted({c.scope for c in checks})})
        raise _full(checks, {(s, k, w): u for s, k, w, u in await cur.fetchall()})

    def settle(self, res: Reservation, tokens_used: int) -> None:
        """Give back what admission took, keeping the tokens actually used. Idempotent: the
        lease is deleted in the same statement/transaction, and a lease already gone means
        this settlement already happened. Synchronous; the gateway uses start_settle()."""
        if res.settled:
            return
        if res.leased:
            if self.pg:
                sql, params = self._settle_pg_sql(res, tokens_used)
                self._with_retry(lambda conn: conn.execute(sql, params))
            else:
                self._with_retry(lambda conn: self._settle_lite(conn, res, tokens_used))
        res.settled = True

    def start_settle(self, res: Reservation, tokens_used: int) -> asyncio.Future:
        if res.settled or not res.leased:
            res.settled = True
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        if not self.pg:
            return asyncio.wrap_future(self.executor.submit(self.settle, res, tokens_used))
        sql, params = self._settle_pg_sql(res, tokens_used)

        async def run() -> None:
            await self._apg(lambda conn: conn.execute(sql, params))
            res.settled = True

        return asyncio.ensure_future(run())

    @staticmethod
    def _settle_lite(conn, res: Reservation, tokens_used: int) -> None:
        conn.execute("BEGIN IMMEDIATE")
        row = conn.execute(_LITE_TAKE, {"r": res.request_id}).fetchone()
        if row is not None:
            rows = _move_rows(_settle_moves(res.charges, tokens_used, row[0] == "live"))
            if rows:
                conn.execute(_SQL.move(len(rows)), _params(rows))
        conn.execute("COMMIT")

    @staticmethod
    def _settle_pg_sql(res: Reservation, tokens_used: int) -> tuple[str, dict]:
        live = {(s, k, w): d for s, k, w, d in _settle_moves(res.charges, tokens_used, True)}
        reaped = {(s, k, w): d for s, k, w, d in _settle_moves(res.charges, tokens_used, False)}
        params: dict = {"r": res.request_id}
        keys = sorted(set(live) | set(reaped))
        for i, (s, k, w) in enumerate(keys):
            params.update({f"s{i}": s, f"k{i}": k, f"w{i}": w, f"dl{i}": live.get((s, k, w), 0),
                           f"dr{i}": reaped.get((s, k, w), 0)})
        return _PG.settle(len(keys)), params

    # -- PostgreSQL's async connections (the gateway's event loop) ------------------------------
    async def _apg(self, op):
        """Run `op(conn)` on an async autocommit connection; one retry on a fresh connection
        when the connection broke (a database restart leaves every pooled one stale)."""
        if self._apool is None:
            self._apool = _AsyncPgPool(self.engine.url.set(drivername="postgresql")
                                       .render_as_string(hide_password=False), self.async_connections)
        for attempt in (0, 1):
            conn = await self._apool.acquire()
            broken = True
            try:
                result = await op(conn)
                broken = False
                return result
            except RateLimitedError:
                broken = False
                raise
            except Exception as exc:
                if attempt or not _is_disconnect(exc):
                    raise
            finally:
                await self._apool.release(conn, broken)

    async def aclose(self) -> None:
        if self._apool is not None:
            await self._apool.close()
            self._apool = None

    # -- maintenance --------------------------------------------------------------------------
    def renew(self, now: float | None = None) -> int:
        """Extend this holder's live leases (the heartbeat)."""
        now = time.time() if now is None else now
        with self.engine.begin() as conn:
            return conn.execute(_RENEW, {"e": int(now + self.lease_ttl), "h": self.holder}).rowcount

    def reap(self, now: float | None = None) -> int:
        """Give back the reservations of expired leases (their holder died or hung), and
        drop counters and lease tombstones nobody needs any more. Returns leases reaped."""
        now = time.time() if now is None else now
        with self.engine.begin() as conn:
            reaped = conn.execute(_REAP, {"now": int(now)}).all()
            moves = [(s, k, w, -a) for _rid, charges in reaped for s, k, w, a in _charges(charges)]
            _move(conn, moves)
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


def _charges(value) -> list[tuple[str, str, int, int]]:
    if isinstance(value, str):  # some drivers hand JSON back as text
        import json

        value = json.loads(value)
    return [(s, k, int(w), int(a)) for s, k, w, a in value]


# -- the per-process limits cache ---------------------------------------------------------
@dataclass
class TenantLimits:
    tenant: Limits | None
    keys: dict[int, Limits] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return self.tenant is None and not self.keys


class QuotaCache:
    """tenant id -> its limits and its keys' limits, trusted for `ttl` seconds. One
    database query per tenant per TTL, however many requests wait for it."""

    def __init__(self, engine: Engine, ttl: float = 5.0, max_entries: int = 100_000) -> None:
        self.engine = engine
        self.ttl = ttl
        self.max_entries = max_entries
        self._cache: dict[int, tuple[TenantLimits, float]] = {}
        self._inflight: dict[int, asyncio.Future] = {}

    async def get(self, tenant_id: int) -> TenantLimits:
        hit = self._cache.get(tenant_id)
        if hit is not None and hit[1] > time.monotonic():
            return hit[0]
        fut = self._inflight.get(tenant_id)
        if fut is None:
            fut = asyncio.ensure_future(asyncio.to_thread(self.load, tenant_id))
            self._inflight[tenant_id] = fut
            fut.add_done_callback(lambda _f: self._inflight.pop(tenant_id, None))
        limits = await asyncio.shield(fut)
        if len(self._cache) >= self.max_entries:
            self._cache.clear()
        self._cache[tenant_id] = (limits, time.monotonic() + self.ttl)
        return limits

    def load(self, tenant_id: int) -> TenantLimits:
        with self.engine.connect() as conn:
            rows = conn.execute(select(Quota).where(Quota.tenant_id == tenant_id)).all()
        out = TenantLimits(None)
        for r in rows:
            lim = Limits(r.rpm, r.tpm, r.max_concurrency, r.token_budget, r.budget_period)
            if lim.empty:
                continue
            if r.key_id is None:
                out.tenant = lim
            else:
                out.keys[r.key_id] = lim
        return out

    def invalidate(self, tenant_id: int | None = None) -> None:
        """Forget cached limits (all, or one tenant's): admin changes made in this process."""
        if tenant_id is None:
            self._cache.clear()
        else:
            self._cache.pop(tenant_id, None)
