"""The limits of tenants and keys: reading, setting and reporting them (admin, CLI)."""
from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass

from sqlalchemy import select

from loraplex.platform.db.base import utcnow
from loraplex.platform.db.database import Database
from loraplex.platform.db.tables import ApiKey, Tenant
from loraplex.platform.db.usage_tables import Quota, QuotaCounter
from loraplex.platform.errors import BadRequestError, NotFoundError
from loraplex.platform.quotas.windows import minute_start, period_bounds
from loraplex.platform.tenancy.tenants import KEY_PREFIX, get_tenant

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
