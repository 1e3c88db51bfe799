"""Quotas and metering composed, without a server, on SQLite and PostgreSQL: the
no-limit fast path, cancellation during admission, a broken connection at settlement,
and a database that is down."""
from __future__ import annotations

import asyncio

import pytest
from loraplex.platform.assembly.usage_hooks import UsageHooks
from loraplex.platform.errors import MeteringUnavailableError
from loraplex.platform.quotas.limits import quota_status, set_quota
from loraplex.platform.settings import QuotaConfig, Settings, UsageConfig
from loraplex.platform.tenancy.tenants import create_tenant
from tests.platform.metering.test_hooks import ctx_of, done


@pytest.fixture
def hooks_factory(db, tmp_path):
    def make() -> UsageHooks:
        return UsageHooks(Settings(database_url=db.url, data_dir=tmp_path, quotas=QuotaConfig(cache_ttl=0.0),
                                   usage=UsageConfig(flush_seconds=0.01)))

    return make


def test_unlimited_tenant_touches_no_quota_table(db, hooks_factory):
    t = create_tenant(db, "free")
    hooks = hooks_factory()

    async def main():
        await hooks.start()
        for _ in range(5):
            ctx = ctx_of(t, "free")
            await hooks.admit(ctx)
            assert ctx.hook_state is None  # no reservation: no database work
            await hooks.finish(done(ctx, 5))
        assert hooks.open_requests == 0
        await hooks.close()

    asyncio.run(main())
    assert hooks.metering.writer.written == 5


def test_cancelled_admission_gives_everything_back(db, hooks_factory):
    t = create_tenant(db, "acme")
    set_quota(db, "acme", max_concurrency=2, token_budget=1000)
    hooks = hooks_factory()
    store = hooks.quotas.store
    start = store.start_reserve

    def slow_start(*a):
        async def later():
            await asyncio.sleep(0.05)
            return await start(*a)
        return asyncio.ensure_future(later())

    store.start_reserve = slow_start

    async def main():
        await hooks.start()
        task = asyncio.ensure_future(hooks.admit(ctx_of(t, "acme")))
        await asyncio.sleep(0.01)
        task.cancel()  # the client left while admission was in the database
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)
        assert hooks.metering.writer.flush(5)  # the give-back runs on the usage writer's thread
        await hooks.close()

    asyncio.run(main())
    st = quota_status(db, "acme")
    assert st.in_flight == 0 and st.budget_used == 0 and hooks.open_requests == 0


def test_settlement_survives_a_broken_connection(db, hooks_factory):
    """Every pooled quota connection dies (a database restart): the next request works."""
    t = create_tenant(db, "acme")
    set_quota(db, "acme", max_concurrency=5, tpm=10_000)
    hooks = hooks_factory()

    async def one(out: int):
        ctx = ctx_of(t, "acme")
        await hooks.admit(ctx)
        await hooks.finish(done(ctx, out))

    async def main():
        await hooks.start()
        await one(3)
        await _kill_connections(hooks)
        await one(4)
        await _kill_connections(hooks)
        await one(5)
        await hooks.close()

    asyncio.run(asyncio.wait_for(main(), 60))
    st = quota_status(db, "acme")
    assert st.in_flight == 0 and st.tokens_this_minute == 3 * 10 + 3 + 4 + 5


async def _kill_connections(hooks: UsageHooks) -> None:
    store = hooks.quotas.store
    if hooks.quotas.quota_engine.dialect.name == "postgresql":  # the server ends the sessions, as a restart does
        import psycopg

        from tests.platform.fixtures import PG_BASE

        with psycopg.connect(PG_BASE.replace("+psycopg", ""), autocommit=True) as admin:
            killed = admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                                   (store.application_name,)).fetchall()
        assert killed
    else:
        for fairy in list(store._conns):
            fairy.driver_connection.close()


def test_a_database_that_is_down_means_503_not_unmetered(db, hooks_factory):
    t = create_tenant(db, "acme")
    set_quota(db, "acme", rpm=100)
    hooks = hooks_factory()

    async def main():
        await hooks.start()
        await hooks.quotas.limits.get(t.id)  # limits cached
        hooks.quotas.store.start_reserve = lambda *a: _failing()
        with pytest.raises(MeteringUnavailableError):
            await hooks.admit(ctx_of(t, "acme"))
        await hooks.close()

    asyncio.run(main())
    assert hooks.open_requests == 0


def _failing() -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_exception(ConnectionError("database unavailable"))
    return fut
