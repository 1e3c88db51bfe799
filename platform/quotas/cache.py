"""The per-process limits cache: one query per tenant per TTL."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from sqlalchemy import Engine, select

from loraplex.platform.db.usage_tables import Quota
from loraplex.platform.quotas.limits import Limits


@dataclass
class TenantLimits:
    tenant: Limits | None
    keys: dict[int, Limits] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return self.tenant is None and not self.keys


class QuotaCache:
    """tenant id -> its limits and its keys' limits, trusted for `ttl` seconds. One
    database query per tenant per TTL, however many requests wait for it.

    While the database is unreachable, limits read less than `stale_for` seconds ago are
    used as they were (so a tenant without limits keeps being served); older ones are not
    trusted and the lookup raises."""

    def __init__(self, engine: Engine, ttl: float = 5.0, max_entries: int = 100_000, stale_for: float = 300.0) -> None:
        self.engine = engine
        self.ttl = ttl
        self.stale_for = stale_for
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
        try:
            limits = await asyncio.shield(fut)
        except Exception:
            if hit is not None and hit[1] + self.stale_for > time.monotonic():
                return hit[0]
            raise
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
