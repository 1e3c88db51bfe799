"""The quota/metering hooks without a server, on SQLite and PostgreSQL: the no-limit fast
path, cancellation during admission, a broken connection, a database that is down, and
the billing rules for a request's tokens."""
from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from loraplex.engine.request import Lane
from loraplex.platform.serving.auth import Principal
from loraplex.platform.errors import MeteringUnavailableError, RateLimitedError
from loraplex.platform.serving.hooks import RequestContext
from loraplex.platform.quotas.limits import quota_status, set_quota
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy.tenants import create_tenant
from loraplex.engine.output import RequestOutput
from loraplex.platform.metering.hooks import UsageHooks, billed_tokens, checkpoint_of, event_of


def _ctx(t, name: str, max_tokens: int = 20, prompt: int = 10) -> RequestContext:
    p = Principal(t.id, name, 7, "abcdefabcdef", Lane.STANDARD, frozenset([Lane.STANDARD]), frozenset())
    return RequestContext(f"cmpl-{uuid.uuid4().hex}", p, "m", None, Lane.STANDARD, prompt, max_tokens)


def _done(ctx: RequestContext, out: int, reason: str = "length") -> RequestContext:
    ctx.num_output_tokens, ctx.finish_reason = out, reason
    ctx.first_token_at = ctx.finished_at = time.time()
    return ctx


@pytest.fixture
def hooks_factory(db, tmp_path):
    made = []

    def make(**kw) -> UsageHooks:
        h = UsageHooks(Settings(database_url=db.url, data_dir=tmp_path, quota_cache_ttl=0.0,
                                usage_flush_seconds=0.01, **kw))
        made.append(h)
        return h

    yield make


def test_billing_rules():
    t = type("T", (), {"id": 1})
    ctx = _ctx(t, "acme")
    assert billed_tokens(_done(ctx, 0, "abort")) == (0, 0, 0)  # left before the engine ran it: nothing
    ctx.num_processed_prompt_tokens = 8
    assert billed_tokens(_done(ctx, 0, "abort")) == (8, 0, 0)  # left mid-prefill: the chunks that ran
    ctx.num_cached_tokens = 4
    assert billed_tokens(_done(ctx, 3, "abort")) == (10, 4, 3)  # left mid-stream: what was generated
    ev = event_of(_done(ctx, 3, "abort"))
    assert ev.status == "aborted" and ev.total_tokens == 13 and ev.key_id == 7 and ev.lane == 1


def test_events_and_checkpoints_keep_the_correlation_id():
    # A crash checkpoint is what gets billed after a kill -9: it must join the logs too.
    ctx = _ctx(type("T", (), {"id": 1}), "acme")
    ctx.correlation_id = "client-req-7"
    out = RequestOutput(ctx.request_id, [5], "x", False, num_processed_prompt_tokens=10)
    assert checkpoint_of(ctx, out, time.time()).correlation_id == "client-req-7"
    assert event_of(_done(ctx, 1)).correlation_id == "client-req-7"


def test_checkpoints_every_16_tokens_and_1_second_whichever_is_later(db, hooks_factory):
    h = hooks_factory()
    t = create_tenant(db, "acme")
    e = event_of(_done(_ctx(t, "acme"), 0))
    rid, due = e.request_id, h.ledger.due
    assert due(rid, 0, 100.0), "the first output always checkpoints"
    assert h.journal.wait_durable(h.ledger.checkpoint(e, None, 100.0))
    assert not due(rid, 15, 200.0) and not due(rid, 500, 100.9)
    assert due(rid, 16, 101.0) and due(rid, 500, 101.0)
    h.ledger.forget(rid)
    assert h.journal.pinned() == 0


def test_unlimited_tenant_touches_no_quota_table(db, hooks_factory):
    t = create_tenant(db, "free")
    hooks = hooks_factory()

    async def main():
        await hooks.start()
        for _ in range(5):
            ctx = _ctx(t, "free")
            await hooks.admit(ctx)
            assert ctx.hook_state is None  # no reservation: no database work
            await hooks.finish(_done(ctx, 5))
        assert hooks.open_requests == 0
        await hooks.close()

    asyncio.run(main())
    assert hooks.writer.written == 5


def test_cancelled_admission_gives_everything_back(db, hooks_factory):
    t = create_tenant(db, "acme")
    set_quota(db, "acme", max_concurrency=2, token_budget=1000)
    hooks = hooks_factory()
    start = hooks.store.start_reserve

    def slow_start(*a):
        async def later():
            await asyncio.sleep(0.05)
            return await start(*a)
        return asyncio.ensure_future(later())

    hooks.store.start_reserve = slow_start

    async def main():
        await hooks.start()
        task = asyncio.ensure_future(hooks.admit(_ctx(t, "acme")))
        await asyncio.sleep(0.01)
        task.cancel()  # the client left while admission was in the database
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)
        assert hooks.writer.flush(5)
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
        ctx = _ctx(t, "acme")
        await hooks.admit(ctx)
        await hooks.finish(_done(ctx, out))

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
    store = hooks.store
    if hooks.quota_engine.dialect.name == "postgresql":  # the server ends the sessions, as a restart does
        import psycopg

        from tests.platform.fixtures import PG_BASE

        with psycopg.connect(PG_BASE.replace("+psycopg", ""), autocommit=True) as admin:
            killed = admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                                   (store.application_name,)).fetchall()
        assert killed
    else:
        for fairy in list(store._conns):
            fairy.driver_connection.close()


def test_database_down_means_503_not_unmetered(db, hooks_factory):
    t = create_tenant(db, "acme")
    set_quota(db, "acme", rpm=100)
    hooks = hooks_factory()

    async def main():
        await hooks.start()
        await hooks.limits.get(t.id)  # limits cached
        hooks.store.start_reserve = lambda *a: _failing()
        with pytest.raises(MeteringUnavailableError):
            await hooks.admit(_ctx(t, "acme"))
        for _ in range(3):  # a backlog of unwritten events over the limit: 503 as well
            hooks.writer.submit(event_of(_done(_ctx(t, "acme"), 1)))
        hooks.writer.max_buffer = 1
        hooks.writer._stop = False
        with pytest.raises(MeteringUnavailableError):
            await hooks.admit(_ctx(t, "acme"))
        hooks.writer.max_buffer = 100_000
        await hooks.close()

    asyncio.run(main())
    assert hooks.open_requests == 0


def _failing() -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_exception(ConnectionError("database unavailable"))
    return fut


def test_rejections_release_nothing_they_did_not_take(db, hooks_factory):
    t = create_tenant(db, "acme")
    set_quota(db, "acme", max_concurrency=1, token_budget=100)
    hooks = hooks_factory()

    async def main():
        await hooks.start()
        first = _ctx(t, "acme", max_tokens=50)
        await hooks.admit(first)
        with pytest.raises(RateLimitedError, match="max-concurrency"):
            await hooks.admit(_ctx(t, "acme", max_tokens=10))
        await hooks.finish(_done(first, 7))  # used 17 of the 60 reserved
        with pytest.raises(RateLimitedError, match="token budget"):
            await hooks.admit(_ctx(t, "acme", max_tokens=80))  # 90 > 83 left
        ok = _ctx(t, "acme", max_tokens=70)
        await hooks.admit(ok)
        await hooks.finish(_done(ok, 0, "error"))  # failed before any output: costs nothing
        await hooks.close()

    asyncio.run(main())
    st = quota_status(db, "acme")
    assert (st.in_flight, st.budget_used) == (0, 17)


def test_the_shutdown_drain_is_the_writers_close_timeout(hooks_factory):
    """`--usage-drain-timeout`: how long closing keeps writing the journal to the database."""
    import asyncio

    hooks = hooks_factory(usage_drain_seconds=240.0)
    assert hooks.writer.close_timeout == 240.0
    asyncio.run(hooks.close())
    with pytest.raises(ValueError, match="usage_drain_seconds"):
        Settings(usage_drain_seconds=-1)
