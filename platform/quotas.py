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
import datetime as dt
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from sqlalchemy import JSON, Engine, bindparam, delete, select, text

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
                raise RateLimitedError(
                    f"{c.label}: this request needs up to {c.amount} tokens (prompt + max_tokens), more than its "
                    f"whole {LIMIT_NAMES[c.kind]} of {c.limit}; lower max_tokens", c.retry_after)
            raise RateLimitedError(f"{c.label} has a {LIMIT_NAMES[c.kind]} limit of {c.limit}", c.retry_after)
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
    return RateLimitedError(f"{msg}; retry after {max(1, round(retry))} s", retry)


class _Sql:
    """Statement texts, cached per number of rows (text() compiles once per string)."""

    def __init__(self) -> None:
        self._admit: dict[int, object] = {}
        self._move: dict[int, object] = {}

    @staticmethod
    def _values(n: int) -> str:
        return ", ".join(f"(:s{i}, :k{i}, :w{i}, :u{i}, :l{i})" for i in range(n))

    def admit(self, n: int):
        stmt = self._admit.get(n)
        if stmt is None:
            stmt = self._admit[n] = text(
                f"INSERT INTO quota_counters (scope, kind, window_start, used, lim) VALUES {self._values(n)} "
                "ON CONFLICT (scope, kind, window_start) DO UPDATE SET used = quota_counters.used + excluded.used, "
                "lim = excluded.lim WHERE quota_counters.used + excluded.used <= excluded.lim "
                "RETURNING scope, kind")
        return stmt

    def move(self, n: int):
        """Unconditional counter moves (settle, release): same sorted upsert shape."""
        stmt = self._move.get(n)
        if stmt is None:
            stmt = self._move[n] = text(
                f"INSERT INTO quota_counters (scope, kind, window_start, used, lim) VALUES {self._values(n)} "
                "ON CONFLICT (scope, kind, window_start) DO UPDATE SET used = quota_counters.used + excluded.used")
        return stmt


_SQL = _Sql()
_INSERT_LEASE = text("INSERT INTO quota_leases (request_id, holder, state, expires_at, charges) "
                     "VALUES (:r, :h, 'live', :e, :c)").bindparams(bindparam("c", type_=JSON))
_TAKE_LEASE = text("DELETE FROM quota_leases WHERE request_id = :r RETURNING state")
_RENEW = text("UPDATE quota_leases SET expires_at = :e WHERE holder = :h AND state = 'live'")
_REAP = text("UPDATE quota_leases SET state = 'reaped' WHERE state = 'live' AND expires_at < :now "
             "RETURNING request_id, charges")


def _params(rows: list[tuple[str, str, int, int, int]]) -> dict:
    p = {}
    for i, (s, k, w, u, lim) in enumerate(rows):
        p[f"s{i}"], p[f"k{i}"], p[f"w{i}"], p[f"u{i}"], p[f"l{i}"] = s, k, w, u, lim
    return p


def _move(conn, moves: list[tuple[str, str, int, int]]) -> None:
    rows = sorted((s, k, w, d, 0) for s, k, w, d in moves if d != 0)
    if rows:
        conn.execute(_SQL.move(len(rows)), _params(rows))


class QuotaStore:
    """The database side of quotas for one gateway process (`holder`). Synchronous: the
    hooks call it through `asyncio.to_thread`."""

    def __init__(self, engine: Engine, holder: str, lease_ttl: float = 60.0) -> None:
        self.engine = engine
        self.holder = holder
        self.lease_ttl = lease_ttl

    def reserve(self, request_id: str, checks: list[_Check], now: float) -> Reservation:
        """Take every counter in `checks` or none; raise RateLimitedError naming the limit."""
        rows = [(c.scope, c.kind, c.window, c.amount, c.limit) for c in checks]
        charges = [(c.scope, c.kind, c.window, c.amount) for c in checks if c.kind != "rpm"]
        with self.engine.connect() as conn:
            got = {(s, k) for s, k in conn.execute(_SQL.admit(len(rows)), _params(rows))}
            if len(got) < len(rows):
                conn.rollback()
                raise rejection([c for c in checks if (c.scope, c.kind) not in got])
            if charges:
                conn.execute(_INSERT_LEASE, {"r": request_id, "h": self.holder,
                                             "e": int(now + self.lease_ttl), "c": [list(c) for c in charges]})
            conn.commit()
        return Reservation(request_id, charges, bool(charges))

    def settle(self, res: Reservation, tokens_used: int) -> None:
        """Give back what admission took, keeping the tokens actually used. Idempotent."""
        if res.settled:
            return
        if not res.leased:
            res.settled = True
            return
        with self.engine.connect() as conn:
            row = conn.execute(_TAKE_LEASE, {"r": res.request_id}).first()
            if row is not None:
                live = row[0] == "live"
                moves = []
                for scope, kind, window, amount in res.charges:
                    if kind == "conc":
                        if live:
                            moves.append((scope, kind, window, -amount))
                    else:  # tpm, budget: the reservation becomes the actual use
                        moves.append((scope, kind, window, tokens_used - amount if live else tokens_used))
                _move(conn, moves)
            conn.commit()
        res.settled = True

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
