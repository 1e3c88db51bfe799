"""The quota hooks without a server, on SQLite and PostgreSQL: a rejection takes nothing,
a database that is down means 503, not unmetered service."""
from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from loraplex.engine.request import Lane
from loraplex.platform.errors import MeteringUnavailableError, RateLimitedError
from loraplex.platform.quotas.hooks import QuotaHooks
from loraplex.platform.quotas.limits import quota_status, set_quota
from loraplex.platform.serving.auth import Principal
from loraplex.platform.serving.hooks import RequestContext
from loraplex.platform.settings import QuotaConfig
from loraplex.platform.tenancy.tenants import create_tenant


def ctx_of(t, name: str, max_tokens: int = 20, prompt: int = 10) -> RequestContext:
    p = Principal(t.id, name, 7, "abcdefabcdef", Lane.STANDARD, frozenset([Lane.STANDARD]), frozenset())
    return RequestContext(f"cmpl-{uuid.uuid4().hex}", p, "m", None, Lane.STANDARD, prompt, max_tokens)


@pytest.fixture
def quotas(db):
    """QuotaHooks whose background work runs on a thread of its own, awaited at the end."""
    pool = ThreadPoolExecutor(1)
    hooks = QuotaHooks(QuotaConfig(cache_ttl=0.0), db.url, uuid.uuid4().hex[:16], pool.submit)
    yield hooks
    pool.shutdown(wait=True)


async def _settle(hooks: QuotaHooks, ctx: RequestContext, used: int) -> None:
    settled = []
    await hooks.settle(ctx, used, settled=lambda: settled.append(ctx.request_id), retry=hooks.background)
    assert settled == [ctx.request_id]


def test_rejections_release_nothing_they_did_not_take(db, quotas):
    t = create_tenant(db, "acme")
    set_quota(db, "acme", max_concurrency=1, token_budget=100)

    async def main():
        first = ctx_of(t, "acme", max_tokens=50)
        await quotas.admit(first)
        assert quotas.charges(first)
        with pytest.raises(RateLimitedError, match="max-concurrency"):
            await quotas.admit(ctx_of(t, "acme", max_tokens=10))
        await _settle(quotas, first, 17)  # used 17 of the 60 reserved
        assert quotas.charges(first) is None
        with pytest.raises(RateLimitedError, match="token budget"):
            await quotas.admit(ctx_of(t, "acme", max_tokens=80))  # 90 > 83 left
        ok = ctx_of(t, "acme", max_tokens=70)
        await quotas.admit(ok)
        await _settle(quotas, ok, 0)  # failed before any output: costs nothing
        await quotas.close()

    asyncio.run(main())
    st = quota_status(db, "acme")
    assert (st.in_flight, st.budget_used) == (0, 17)
    assert quotas.rejections == {"conc": 1, "budget": 1}


def test_an_unreachable_quota_store_means_503_not_unmetered(db, quotas):
    t = create_tenant(db, "acme")
    set_quota(db, "acme", rpm=100)

    def failing(*_a) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        fut.set_exception(ConnectionError("database unavailable"))
        return fut

    async def main():
        await quotas.limits.get(t.id)  # limits cached
        quotas.store.start_reserve = failing
        ctx = ctx_of(t, "acme")
        with pytest.raises(MeteringUnavailableError):
            await quotas.admit(ctx)
        assert ctx.hook_state is None
        await quotas.close()

    asyncio.run(main())
