"""API keys and tenants: format, hashing, the auth cache and its bounded staleness, lanes."""
from __future__ import annotations

import asyncio
import datetime as dt
import time

import pytest
from sqlalchemy import select

from loraplex.engine.request import Lane
from loraplex.platform.serving.auth import Authenticator, Principal
from loraplex.platform.errors import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitedError,
)
from loraplex.platform.db.tables import ApiKey
from loraplex.platform.tenancy.throttle import ThrottleConfig
from loraplex.platform.tenancy.tenants import (
    create_key,
    create_tenant,
    hash_key,
    key_prefix,
    list_tenants,
    revoke_key,
    set_tenant_enabled,
)


def _run(coro):
    return asyncio.run(coro)


def test_key_format_and_storage(db):
    create_tenant(db, "acme")
    key = create_key(db, "acme")
    prefix = key_prefix(key)
    assert key.startswith(f"lpx_{prefix}_") and len(key) == 4 + 12 + 1 + 43
    with db.session() as s:
        row = s.scalars(select(ApiKey)).one()
    assert row.prefix == prefix and row.secret_hash == hash_key(key)
    assert key not in (row.secret_hash, row.prefix)  # the key itself is never stored
    assert create_key(db, "acme") != key


def test_tenant_rules(db):
    t = create_tenant(db, "acme", "standard")
    assert t.allowed_lanes == ("standard", "batch")
    with pytest.raises(ConflictError):
        create_tenant(db, "acme")
    with pytest.raises(BadRequestError):
        create_tenant(db, "bad name!")
    with pytest.raises(BadRequestError):
        create_tenant(db, "x", "batch", ["interactive"])  # allowed above its own lane
    with pytest.raises(NotFoundError):
        create_key(db, "nobody")
    assert [x.name for x in list_tenants(db)] == ["acme"]


def test_authenticate_valid_unknown_and_malformed(db):
    create_tenant(db, "acme", "interactive")
    key = create_key(db, "acme")
    auth = Authenticator(db, ttl=60)

    async def go():
        p = await auth.authenticate(f"Bearer {key}")
        assert (p.tenant, p.lane) == ("acme", Lane.INTERACTIVE)
        assert p.allowed_lanes == {Lane.INTERACTIVE, Lane.STANDARD, Lane.BATCH}
        for bad in (None, "", "Basic abc", "Bearer ", f"Bearer {key[:-1]}x", "Bearer lpx_nothex_abc"):
            with pytest.raises(AuthenticationError):
                await auth.authenticate(bad)

    _run(go())


def test_revocation_takes_effect_within_ttl(db):
    create_tenant(db, "acme")
    key = create_key(db, "acme")
    auth = Authenticator(db, ttl=0.3)

    async def go():
        await auth.authenticate(f"Bearer {key}")
        revoke_key(db, key_prefix(key))
        await auth.authenticate(f"Bearer {key}")  # still cached: bounded staleness
        await asyncio.sleep(0.35)
        with pytest.raises(AuthenticationError, match="revoked"):
            await auth.authenticate(f"Bearer {key}")

    _run(go())


def test_expiry_is_exact_even_when_cached(db):
    create_tenant(db, "acme")
    soon = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=0.5)
    key = create_key(db, "acme", expires_at=soon)
    old = create_key(db, "acme", expires_at=dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=1))
    auth = Authenticator(db, ttl=60)

    async def go():
        await auth.authenticate(f"Bearer {key}")
        with pytest.raises(AuthenticationError, match="expired"):
            await auth.authenticate(f"Bearer {old}")
        await asyncio.sleep(max(0.0, soon.timestamp() - time.time()) + 0.05)
        with pytest.raises(AuthenticationError, match="expired"):
            await auth.authenticate(f"Bearer {key}")

    _run(go())


def test_disabled_tenant_is_refused(db):
    create_tenant(db, "acme")
    key = create_key(db, "acme")
    set_tenant_enabled(db, "acme", False)
    with pytest.raises(AuthenticationError, match="disabled"):
        _run(Authenticator(db).authenticate(f"Bearer {key}"))


def test_last_used_is_batched_not_per_request(db):
    create_tenant(db, "acme")
    key = create_key(db, "acme")
    auth = Authenticator(db, ttl=60, flush_seconds=0)

    def last_used():
        with db.session() as s:
            return s.scalars(select(ApiKey.last_used_at)).one()

    async def go():
        for _ in range(5):
            await auth.authenticate(f"Bearer {key}")
        assert last_used() is None  # nothing written on the request path
        await auth.flush_last_used()
        assert last_used() is not None

    _run(go())


def test_concurrent_lookups_hit_the_database_once(db):
    create_tenant(db, "acme")
    key = create_key(db, "acme")
    auth = Authenticator(db, ttl=60)
    calls = []
    real = auth._load
    auth._load = lambda *a: calls.append(1) or real(*a)

    async def go():
        await asyncio.gather(*(auth.authenticate(f"Bearer {key}") for _ in range(20)))

    _run(go())
    assert len(calls) == 1


def _principal(lane: Lane, allowed) -> Principal:
    return Principal(1, "t", 1, "p", lane, frozenset(allowed), frozenset())


def test_lanes_only_go_down():
    p = _principal(Lane.STANDARD, {Lane.STANDARD, Lane.BATCH})
    assert p.lane_for(None) == Lane.STANDARD
    assert p.lane_for(Lane.BATCH) == Lane.BATCH
    with pytest.raises(PermissionDeniedError, match="above"):
        p.lane_for(Lane.INTERACTIVE)
    with pytest.raises(PermissionDeniedError, match="not allowed"):
        _principal(Lane.INTERACTIVE, {Lane.INTERACTIVE}).lane_for(Lane.BATCH)


JUNK = "lpx_0123456789ab_" + "j" * 43  # well formed, in no database


def test_failed_keys_are_throttled_per_client_address_but_valid_keys_are_served(db):
    create_tenant(db, "acme")
    key = create_key(db, "acme")
    auth = Authenticator(db, ttl=60, throttle=ThrottleConfig(burst=3, per_second=0.01))

    async def go():
        await auth.refresh_known_keys()
        for bad in ("Bearer lpx_0123456789ab_0", f"Bearer {JUNK}", None):
            with pytest.raises(AuthenticationError):
                await auth.authenticate(bad, client="10.1.1.1")
        for bad in (f"Bearer {JUNK}", "Bearer junk", None):
            with pytest.raises(RateLimitedError) as err:
                await auth.authenticate(bad, client="10.1.1.1")
            assert err.value.retry_after > 1
        assert (await auth.authenticate(f"Bearer {key}", client="10.1.1.1")).tenant == "acme"
        # Until the set of known keys is first loaded, a throttled address's keys are looked up.
        fresh = Authenticator(db, ttl=60, throttle=ThrottleConfig(burst=1, per_second=0.01))
        with pytest.raises(AuthenticationError):
            await fresh.authenticate(f"Bearer {JUNK}", client="10.1.1.1")
        assert (await fresh.authenticate(f"Bearer {key}", client="10.1.1.1")).tenant == "acme"
        assert (await auth.authenticate(f"Bearer {key}", client="10.1.1.2")).tenant == "acme"
        assert (await auth.authenticate(f"Bearer {key}")).tenant == "acme"

    _run(go())


def _count_queries(db) -> list[str]:
    from sqlalchemy import event

    seen: list[str] = []
    event.listen(db.engine, "before_cursor_execute", lambda _c, _cur, stmt, *_a: seen.append(stmt))
    return seen


def test_a_throttled_address_costs_no_query_for_unknown_keys_and_learns_new_keys(db):
    """Other tenants behind the same address keep working, new keys (created by another
    process) included once the known set is refreshed; unknown keys never reach the DB."""
    create_tenant(db, "acme")
    create_tenant(db, "beta")
    beta = create_key(db, "beta")
    auth = Authenticator(db, ttl=60, throttle=ThrottleConfig(burst=2, per_second=0.01))

    async def go():
        await auth.refresh_known_keys()
        for i in range(2):
            with pytest.raises(AuthenticationError):
                await auth.authenticate(f"Bearer lpx_0123456789a{i}_" + "x" * 43, client="10.0.0.9")
        queries = _count_queries(db)
        for i in range(50):
            with pytest.raises(RateLimitedError):
                await auth.authenticate(f"Bearer lpx_0123456789{i:02d}_" + "y" * 43, client="10.0.0.9")
        assert queries == []
        assert (await auth.authenticate(f"Bearer {beta}", client="10.0.0.9")).tenant == "beta"
        late = create_key(db, "acme")  # as by the CLI or another replica
        queries.clear()
        with pytest.raises(RateLimitedError):  # not known here until the next refresh
            await auth.authenticate(f"Bearer {late}", client="10.0.0.9")
        assert queries == []
        await auth.refresh_known_keys()
        assert (await auth.authenticate(f"Bearer {late}", client="10.0.0.9")).tenant == "acme"
        # Revoked elsewhere: still known, so looked up (after the cache's TTL) and refused.
        revoked = create_key(db, "acme")
        await auth.refresh_known_keys()
        revoke_key(db, key_prefix(revoked))
        with pytest.raises(AuthenticationError, match="revoked"):
            await auth.authenticate(f"Bearer {revoked}", client="10.0.0.9")
        await auth.close()

    _run(go())


def test_known_keys_reach_back_for_ids_committed_late_and_reload_in_full(db):
    from loraplex.platform.tenancy.known_keys import KnownKeys

    create_tenant(db, "acme")
    keys = [create_key(db, "acme") for _ in range(3)]
    now = [0.0]
    known = KnownKeys(db, full_reload_seconds=100, clock=lambda: now[0])
    assert not known.loaded
    known.refresh()
    assert known.loaded and all(hash_key(k) in known for k in keys) and len(known) == 3
    with db.session() as s:  # an id below the watermark, as a transaction committed late
        s.add(ApiKey(tenant_id=1, prefix="0000000000aa", secret_hash=hash_key("late")))
        s.execute(ApiKey.__table__.delete().where(ApiKey.secret_hash == hash_key(keys[0])))
    known.refresh()
    assert hash_key("late") in known and hash_key(keys[0]) in known  # incremental: only adds
    now[0] = 200.0
    known.refresh()
    assert hash_key(keys[0]) not in known and len(known) == 3  # the full reload forgets it


def test_readiness_ping_never_waits_behind_key_lookups(db):
    """Key lookups hold every thread of their pool; ping() still reaches the database."""
    import threading

    auth = Authenticator(db, ttl=60)
    release = threading.Event()
    real_load = auth._load

    def slow_load(key, digest):
        release.wait(30)
        return real_load(key, digest)

    auth._load = slow_load

    async def go():
        lookups = [asyncio.ensure_future(auth.authenticate(f"Bearer lpx_0123456789a{i}_" + "x" * 43)) for i in range(8)]
        await asyncio.sleep(0.05)
        await asyncio.wait_for(auth.ping(), timeout=20)  # answers while the lookups are stuck
        assert not any(f.done() for f in lookups)
        release.set()
        for f in lookups:
            with pytest.raises(AuthenticationError):
                await f
        await auth.close()

    _run(go())
