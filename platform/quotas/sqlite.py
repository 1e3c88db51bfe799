"""Quotas on SQLite: one short `BEGIN IMMEDIATE` transaction per admission or settlement
(the write lock first, so no lock upgrade can fail), on the store's threads, each holding
its own raw sqlite3 connection."""
from __future__ import annotations

import asyncio

from loraplex.platform.quotas.admission import Check, Reservation, rejection, settle_moves
from loraplex.platform.quotas.store import QuotaStore, counter_params, counter_values, move_rows, move_sql

_LEASE = ("INSERT INTO quota_leases (request_id, holder, state, expires_at, charges) "
          "VALUES (:r, :h, 'live', :e, :c)")
_TAKE = "DELETE FROM quota_leases WHERE request_id = :r RETURNING state"
_ADMIT: dict[int, str] = {}


def _admit_sql(n: int) -> str:
    sql = _ADMIT.get(n)
    if sql is None:
        sql = _ADMIT[n] = (
            f"INSERT INTO quota_counters (scope, kind, window_start, used, lim) VALUES {counter_values(n)} "
            "ON CONFLICT (scope, kind, window_start) DO UPDATE SET used = quota_counters.used + excluded.used, "
            "lim = excluded.lim WHERE quota_counters.used + excluded.used <= excluded.lim "
            "RETURNING scope, kind")
    return sql


class SqliteQuotaStore(QuotaStore):
    def _prepare(self, raw) -> None:
        raw.isolation_level = None  # explicit BEGIN IMMEDIATE / COMMIT

    def _after_failure(self) -> None:
        fairy = getattr(self._local, "conn", None)
        if fairy is not None and fairy.driver_connection.in_transaction:
            try:
                fairy.driver_connection.execute("ROLLBACK")
            except Exception:  # noqa: BLE001
                self._drop_conn()

    def reserve(self, request_id: str, checks: list[Check], now: float) -> Reservation:
        params, charges = self._reserve_params(request_id, checks, now)
        self._with_retry(lambda conn: self._reserve(conn, checks, params, bool(charges)))
        return Reservation(request_id, charges, bool(charges))

    def start_reserve(self, request_id: str, checks: list[Check], now: float) -> asyncio.Future:
        return asyncio.wrap_future(self.executor.submit(self.reserve, request_id, checks, now))

    @staticmethod
    def _reserve(conn, checks: list[Check], params: dict, lease: bool) -> None:
        conn.execute("BEGIN IMMEDIATE")
        got = set(conn.execute(_admit_sql(len(checks)), params).fetchall())
        if len(got) < len(checks):
            conn.execute("ROLLBACK")
            raise rejection([c for c in checks if (c.scope, c.kind) not in got])
        if lease:
            conn.execute(_LEASE, params)
        conn.execute("COMMIT")

    def settle(self, res: Reservation, tokens_used: int) -> None:
        if res.settled:
            return
        if res.leased:
            self._with_retry(lambda conn: self._settle(conn, res, tokens_used))
        res.settled = True

    def start_settle(self, res: Reservation, tokens_used: int) -> asyncio.Future:
        if res.settled or not res.leased:
            res.settled = True
            return self._done()
        return asyncio.wrap_future(self.executor.submit(self.settle, res, tokens_used))

    @staticmethod
    def _settle(conn, res: Reservation, tokens_used: int) -> None:
        conn.execute("BEGIN IMMEDIATE")
        row = conn.execute(_TAKE, {"r": res.request_id}).fetchone()
        if row is not None:
            rows = move_rows(settle_moves(res.charges, tokens_used, row[0] == "live"))
            if rows:
                conn.execute(move_sql(len(rows)), counter_params(rows))
        conn.execute("COMMIT")
