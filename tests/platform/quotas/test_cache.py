"""The limits cache while the database is unreachable: limits read recently are used as
they were (a tenant without limits keeps being served), older ones are not trusted."""
from __future__ import annotations

import asyncio

import pytest
from loraplex.platform.db.database import make_db_engine
from loraplex.platform.quotas.cache import QuotaCache
from loraplex.platform.quotas.limits import set_quota
from loraplex.platform.tenancy.tenants import create_tenant
from sqlalchemy.exc import OperationalError


def test_stale_limits_are_used_for_a_bounded_time_while_the_database_is_down(db):
    free, capped = create_tenant(db, "free"), create_tenant(db, "capped")
    set_quota(db, "capped", rpm=5)
    engine = make_db_engine(db.url, pre_ping=False)
    down = make_db_engine("postgresql+psycopg://nobody@127.0.0.1:1/none?connect_timeout=2", pre_ping=False)
    cache = QuotaCache(engine, ttl=0.0, stale_for=300.0)

    async def main():
        assert (await cache.get(free.id)).empty and not (await cache.get(capped.id)).empty
        cache.engine = down  # the database goes away; every entry is past its TTL (0 s)
        assert (await cache.get(free.id)).empty
        assert (await cache.get(capped.id)).tenant.rpm == 5
        cache.stale_for = 0.0  # too old to trust now
        with pytest.raises(OperationalError):
            await cache.get(free.id)

    try:
        asyncio.run(main())
    finally:
        engine.dispose()
        down.dispose()
