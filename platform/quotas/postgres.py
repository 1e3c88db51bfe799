"""Quotas on PostgreSQL: admission and settlement are ONE autocommit statement each (one
round trip, no BEGIN/COMMIT), with data-modifying CTEs. Admission divides by zero when
any counter is full, which aborts the whole statement: all-or-nothing. The gateway's
event loop runs them on a `psycopg_pool.AsyncConnectionPool` (no thread hop)."""
from __future__ import annotations

import asyncio

import psycopg
from psycopg_pool import AsyncConnectionPool

from loraplex.platform.db.database import PG_CONNECT_TIMEOUT
from loraplex.platform.errors import RateLimitedError
from loraplex.platform.quotas.admission import Check, Reservation, full_rejection, settle_moves
from loraplex.platform.quotas.store import QuotaStore, is_disconnect

_PEEK = "SELECT scope, kind, window_start, used FROM quota_counters WHERE scope = ANY(%(scopes)s)"
_RESERVE: dict[tuple[int, bool], str] = {}
_SETTLE: dict[int, str] = {}


def _reserve_sql(n: int, lease: bool) -> str:
    sql = _RESERVE.get((n, lease))
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
        _RESERVE[(n, lease)] = sql
    return sql


def _settle_sql(n: int) -> str:
    sql = _SETTLE.get(n)
    if sql is None:
        values = ", ".join(f"(%(s{i})s, %(k{i})s, CAST(%(w{i})s AS BIGINT), CAST(%(dl{i})s AS BIGINT), "
                           f"CAST(%(dr{i})s AS BIGINT))" for i in range(n))
        sql = _SETTLE[n] = (
            "WITH l AS (DELETE FROM quota_leases WHERE request_id = %(r)s RETURNING state) "
            "INSERT INTO quota_counters (scope, kind, window_start, used, lim) "
            "SELECT v.s, v.k, v.w, CASE WHEN l.state = 'live' THEN v.dl ELSE v.dr END, 0 "
            f"FROM (VALUES {values}) AS v(s, k, w, dl, dr) CROSS JOIN l "
            "WHERE CASE WHEN l.state = 'live' THEN v.dl ELSE v.dr END <> 0 ORDER BY v.s, v.k, v.w "
            "ON CONFLICT (scope, kind, window_start) DO UPDATE SET used = quota_counters.used + excluded.used")
    return sql


def _settle_statement(res: Reservation, tokens_used: int) -> tuple[str, dict]:
    live = {(s, k, w): d for s, k, w, d in settle_moves(res.charges, tokens_used, True)}
    reaped = {(s, k, w): d for s, k, w, d in settle_moves(res.charges, tokens_used, False)}
    params: dict = {"r": res.request_id}
    keys = sorted(set(live) | set(reaped))
    for i, (s, k, w) in enumerate(keys):
        params.update({f"s{i}": s, f"k{i}": k, f"w{i}": w, f"dl{i}": live.get((s, k, w), 0),
                       f"dr{i}": reaped.get((s, k, w), 0)})
    return _settle_sql(len(keys)), params


def _taken(exc: psycopg.Error) -> bool:
    """Whether a failed admission statement took nothing because some counter was full
    (False), or went through on an earlier attempt whose answer was lost (True)."""
    if isinstance(exc, psycopg.errors.DivisionByZero):
        return False
    if isinstance(exc, psycopg.errors.UniqueViolation) and exc.diag.table_name == "quota_leases":
        return True
    raise exc


async def _configure(conn: psycopg.AsyncConnection) -> None:
    await conn.execute("SET synchronous_commit TO off")


class PostgresQuotaStore(QuotaStore):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._apool: AsyncConnectionPool | None = None
        # Names this store's pooled sessions in pg_stat_activity.
        self.application_name = f"loraplex-quota {self.holder}"[:63]

    def _prepare(self, raw) -> None:
        raw.autocommit = True

    def reserve(self, request_id: str, checks: list[Check], now: float) -> Reservation:
        params, charges = self._reserve_params(request_id, checks, now)
        self._with_retry(lambda conn: self._reserve(conn, checks, params, bool(charges)))
        return Reservation(request_id, charges, bool(charges))

    @staticmethod
    def _reserve(conn, checks: list[Check], params: dict, lease: bool) -> None:
        try:
            conn.execute(_reserve_sql(len(checks), lease), params)
            return
        except (psycopg.errors.DivisionByZero, psycopg.errors.UniqueViolation) as exc:
            if _taken(exc):
                return
        rows = conn.execute(_PEEK, {"scopes": sorted({c.scope for c in checks})}).fetchall()
        raise full_rejection(checks, {(s, k, w): u for s, k, w, u in rows})

    def start_reserve(self, request_id: str, checks: list[Check], now: float) -> asyncio.Future:
        params, charges = self._reserve_params(request_id, checks, now)

        async def run() -> Reservation:
            await self._apg(lambda conn: self._areserve(conn, checks, params, bool(charges)))
            return Reservation(request_id, charges, bool(charges))

        return asyncio.ensure_future(run())

    @staticmethod
    async def _areserve(conn, checks: list[Check], params: dict, lease: bool) -> None:
        try:
            await conn.execute(_reserve_sql(len(checks), lease), params)
            return
        except (psycopg.errors.DivisionByZero, psycopg.errors.UniqueViolation) as exc:
            if _taken(exc):
                return
        cur = await conn.execute(_PEEK, {"scopes": sorted({c.scope for c in checks})})
        raise full_rejection(checks, {(s, k, w): u for s, k, w, u in await cur.fetchall()})

    def settle(self, res: Reservation, tokens_used: int) -> None:
        if res.settled:
            return
        if res.leased:
            sql, params = _settle_statement(res, tokens_used)
            self._with_retry(lambda conn: conn.execute(sql, params))
        res.settled = True

    def start_settle(self, res: Reservation, tokens_used: int) -> asyncio.Future:
        if res.settled or not res.leased:
            res.settled = True
            return self._done()
        sql, params = _settle_statement(res, tokens_used)

        async def run() -> None:
            await self._apg(lambda conn: conn.execute(sql, params))
            res.settled = True

        return asyncio.ensure_future(run())

    async def _apg(self, op):
        """Run `op(conn)` on a pooled async autocommit connection; one retry on a fresh
        connection when it broke (a database restart leaves every pooled one stale)."""
        if self._apool is None:
            conninfo = self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
            # A request waits at most PG_CONNECT_TIMEOUT for a connection (the pool's default
            # is 30 s): while the database is unreachable its 503 comes in seconds, not half
            # a minute of holding its client and its concurrency slot.
            self._apool = AsyncConnectionPool(conninfo, min_size=1, max_size=self.threads, open=False,
                                              timeout=PG_CONNECT_TIMEOUT,
                                              kwargs={"autocommit": True, "application_name": self.application_name,
                                                      "connect_timeout": PG_CONNECT_TIMEOUT},
                                              configure=_configure)
            await self._apool.open()
        for attempt in (0, 1):
            try:
                async with self._apool.connection() as conn:
                    return await op(conn)
            except RateLimitedError:
                raise
            except Exception as exc:
                if attempt or not is_disconnect(exc):
                    raise
                await self._apool.check()  # the others are likely stale too: drop every broken one

    async def aclose(self) -> None:
        if self._apool is not None:
            await self._apool.close()
            self._apool = None
