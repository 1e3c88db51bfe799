"""Quotas at the database level, on SQLite and PostgreSQL: limits CRUD, all-or-nothing
admission, settlement, leases and the reaper, and concurrent admissions from many threads."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from loraplex.platform.db.database import make_db_engine
from loraplex.platform.errors import BadRequestError, NotFoundError, RateLimitedError
from loraplex.platform.quotas.admission import plan_admission
from loraplex.platform.quotas.cache import QuotaCache
from loraplex.platform.quotas.limits import Limits, get_quota, list_quotas, quota_status, set_quota, tenant_scope
from loraplex.platform.quotas.dialects import open_quota_store
from loraplex.platform.quotas.windows import period_bounds
from loraplex.platform.tenancy.tenants import create_key, create_tenant
from loraplex.platform.db.usage_tables import QuotaLease
from sqlalchemy import func, select

NOW = 1_800_000_010.0  # 10 s into a minute


@pytest.fixture
def store(db):
    engine = make_db_engine(db.url, pre_ping=False, pool_size=10, max_overflow=10)
    yield open_quota_store(engine, "holder-a", lease_ttl=30)
    engine.dispose()


def _limits(db, tenant: str, **limits) -> Limits:
    return set_quota(db, tenant, **limits).limits


def _reserve(store, tid, limits, tokens, rid, now=NOW):
    checks = plan_admission([(tenant_scope(tid), "tenant t", limits)], tokens, now)
    return store.reserve(rid, checks, now)


def test_set_get_clear_and_key_quotas(db):
    create_tenant(db, "acme")
    key = create_key(db, "acme")
    prefix = key.split("_")[1]
    assert get_quota(db, "acme").limits.empty
    info = set_quota(db, "acme", rpm=10, token_budget=1000)
    assert info.limits == Limits(rpm=10, token_budget=1000, budget_period="month")
    info = set_quota(db, "acme", tpm=500, budget_period="day")  # others kept
    assert info.limits == Limits(rpm=10, tpm=500, token_budget=1000, budget_period="day")
    set_quota(db, "acme", key_prefix=key, max_concurrency=2)  # a whole key works as a prefix too
    assert get_quota(db, "acme", prefix).limits == Limits(max_concurrency=2)
    assert [(q.key_prefix, q.limits.max_concurrency) for q in list_quotas(db, "acme")] == [(None, None), (prefix, 2)]
    assert set_quota(db, "acme", token_budget=None).limits.budget_period is None  # the period goes with it
    set_quota(db, "acme", rpm=None, tpm=None)
    assert get_quota(db, "acme").limits.empty and len(list_quotas(db, "acme")) == 1  # row deleted
    with pytest.raises(BadRequestError, match="rpm must be a whole number"):
        set_quota(db, "acme", rpm=-1)
    with pytest.raises(BadRequestError, match="day or month"):
        set_quota(db, "acme", token_budget=5, budget_period="week")
    with pytest.raises(NotFoundError, match="no tenant named"):
        set_quota(db, "nobody", rpm=1)
    create_tenant(db, "beta")
    with pytest.raises(NotFoundError, match="has no API key"):
        set_quota(db, "beta", key_prefix=prefix, rpm=1)  # another tenant's key


def test_periods():
    assert period_bounds("day", NOW) == (1_799_971_200, 1_800_057_600)
    start, end = period_bounds("month", 1_800_000_000.0)  # 2027-01-15
    assert (start, end) == (1_798_761_600, 1_801_440_000)  # 2027-01-01 .. 2027-02-01
    assert period_bounds("month", 1_796_083_200.0)[1] == 1_798_761_600  # December rolls into January


def test_admission_is_all_or_nothing_and_names_the_limit(db, store):
    t = create_tenant(db, "acme")
    lim = _limits(db, "acme", rpm=100, tpm=1000, max_concurrency=10, token_budget=250, budget_period="day")
    a = _reserve(store, t.id, lim, 100, "r1")
    b = _reserve(store, t.id, lim, 100, "r2")
    with pytest.raises(RateLimitedError) as e:  # the budget has 50 left
        _reserve(store, t.id, lim, 100, "r3")
    assert "token budget of 250" in str(e.value)
    assert e.value.retry_after == pytest.approx(period_bounds("day", NOW)[1] - NOW)  # when the day ends
    st = quota_status(db, "acme", now=NOW)
    # Nothing of the refused request was taken: not its rpm, tpm or concurrency slot.
    assert (st.requests_this_minute, st.tokens_this_minute, st.in_flight, st.budget_used) == (2, 200, 2, 200)
    store.settle(a, 30)  # used 30 of the 100 reserved
    store.settle(a, 30)  # settling twice changes nothing
    st = quota_status(db, "acme", now=NOW)
    assert (st.tokens_this_minute, st.in_flight, st.budget_used, st.budget_remaining) == (130, 1, 130, 120)
    c = _reserve(store, t.id, lim, 100, "r3")  # fits now
    for r in (b, c):
        store.settle(r, 0)
    st = quota_status(db, "acme", now=NOW)
    assert (st.requests_this_minute, st.tokens_this_minute, st.in_flight, st.budget_used) == (3, 30, 0, 30)
    with store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(QuotaLease)).scalar() == 0


@pytest.mark.parametrize("lim, tokens, match, retry", [
    (Limits(rpm=0), 1, "requests-per-minute limit of 0", 50),
    (Limits(tpm=50), 100, "more than its whole tokens-per-minute of 50; lower max_tokens", 50),
    (Limits(max_concurrency=0), 1, "max-concurrency limit of 0", 1),
    (Limits(token_budget=10, budget_period="day"), 11, "whole token budget of 10", None),
])
def test_requests_that_can_never_fit_are_refused_without_the_database(lim, tokens, match, retry):
    with pytest.raises(RateLimitedError, match=match) as e:
        plan_admission([("t:1", "tenant t", lim)], tokens, NOW)
    if retry is not None:
        assert e.value.retry_after == pytest.approx(retry)


def test_rate_windows_and_retry_after(db, store):
    t = create_tenant(db, "acme")
    lim = Limits(rpm=2, tpm=100)
    _reserve(store, t.id, lim, 10, "a")
    _reserve(store, t.id, lim, 10, "b")
    with pytest.raises(RateLimitedError, match="requests-per-minute limit of 2") as e:
        _reserve(store, t.id, lim, 10, "c")
    assert e.value.retry_after == pytest.approx(50)
    _reserve(store, t.id, lim, 10, "c", now=NOW + 50)  # the next minute
    with pytest.raises(RateLimitedError, match="tokens-per-minute limit of 100"):
        _reserve(store, t.id, lim, 95, "d", now=NOW + 51)


def test_tenant_and_key_limits_both_apply(db, store):
    t = create_tenant(db, "acme")
    tenant = (tenant_scope(t.id), "tenant acme", Limits(rpm=3))
    key = ("k:77", "API key lpx_x", Limits(rpm=1))
    store.reserve("a", plan_admission([tenant, key], 1, NOW), NOW)
    with pytest.raises(RateLimitedError, match="API key lpx_x is over its requests-per-minute limit of 1"):
        store.reserve("b", plan_admission([tenant, key], 1, NOW), NOW)
    store.reserve("c", plan_admission([tenant], 1, NOW), NOW)  # another key of the tenant
    assert quota_status(db, "acme", now=NOW).requests_this_minute == 2


def test_leases_renewed_reaped_and_late_settlement(db, store):
    t = create_tenant(db, "acme")
    lim = _limits(db, "acme", max_concurrency=5, token_budget=1000, budget_period="month")
    live = _reserve(store, t.id, lim, 100, "live")
    dead = _reserve(store, t.id, lim, 100, "dead")
    other = open_quota_store(store.engine, "holder-b", lease_ttl=30)
    assert other.reap(NOW + 10) == 0  # nothing expired yet
    # holder-a is alive but only "live" is still running there ("dead"'s settlement was
    # lost): renewing at NOW+20 extends that one lease alone, and "dead" expires at NOW+30.
    assert store.renew(["live"], NOW + 20) == 1
    assert store.renew([], NOW + 20) == 0
    assert other.reap(NOW + 29) == 0
    assert other.reap(NOW + 41) == 1
    st = quota_status(db, "acme", now=NOW)
    assert (st.in_flight, st.budget_used) == (1, 100)  # the dead request's reservation is back
    store.settle(dead, 60)  # it finished after all: its tokens are charged, its slot was already freed
    store.settle(live, 40)
    st = quota_status(db, "acme", now=NOW)
    assert (st.in_flight, st.budget_used) == (0, 100)


def test_many_threads_never_overspend_the_budget(db, store):
    """60 concurrent admissions of 70 tokens against a budget of 1000: 14 fit, exactly."""
    t = create_tenant(db, "acme")
    lim = _limits(db, "acme", max_concurrency=40, token_budget=1000, budget_period="day")
    results: list = []
    barrier = threading.Barrier(12)

    def worker(i: int) -> None:
        barrier.wait()
        for j in range(5):
            try:
                results.append(_reserve(store, t.id, lim, 70, f"r{i}-{j}", now=time.time()))
            except RateLimitedError as exc:
                results.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    admitted = [r for r in results if not isinstance(r, Exception)]
    assert len(admitted) == 1000 // 70 and len(results) == 60
    st = quota_status(db, "acme")
    assert st.budget_used == 70 * len(admitted) <= 1000 and st.in_flight == len(admitted)
    for r in admitted:
        store.settle(r, 70)
    st = quota_status(db, "acme")
    assert st.in_flight == 0 and st.budget_used == 70 * len(admitted)


def test_cache_loads_once_per_ttl(db):
    t = create_tenant(db, "acme")
    engine = make_db_engine(db.url)

    async def main():
        cache = QuotaCache(engine, ttl=60)
        assert (await cache.get(t.id)).empty
        set_quota(db, "acme", rpm=5)
        assert (await cache.get(t.id)).empty  # cached
        cache.invalidate(t.id)
        assert (await cache.get(t.id)).tenant == Limits(rpm=5)

    try:
        asyncio.run(main())
    finally:
        engine.dispose()
