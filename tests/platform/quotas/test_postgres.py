"""The PostgreSQL quota store when the database cannot be reached: a request's admission
fails after the connect timeout, not the connection pool's default half minute."""
from __future__ import annotations

import asyncio
import socket

import pytest
from psycopg_pool import PoolTimeout

from loraplex.platform.db.database import PG_CONNECT_TIMEOUT, make_db_engine
from loraplex.platform.quotas.admission import plan_admission
from loraplex.platform.quotas.dialects import open_quota_store
from loraplex.platform.quotas.limits import Limits, tenant_scope


def test_an_unreachable_database_fails_an_admission_after_the_connect_timeout():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = make_db_engine(f"postgresql+psycopg://postgres@127.0.0.1:{port}/test", pre_ping=False)
    store = open_quota_store(engine, "holder-a", lease_ttl=30)
    checks = plan_admission([(tenant_scope(1), "tenant t", Limits(max_concurrency=2))], 10, 1_800_000_000.0)

    async def admit() -> None:
        try:
            await store.start_reserve("req-1", checks, 1_800_000_000.0)
        finally:
            await store.aclose()

    with pytest.raises(PoolTimeout, match=rf"after {PG_CONNECT_TIMEOUT:.2f} sec"):
        asyncio.run(admit())
    engine.dispose()
