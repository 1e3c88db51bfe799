"""API keys and tenants: format, hashing, the auth cache and its bounded staleness, lanes."""
from __future__ import annotations

import asyncio
import datetime as dt
import time

import pytest
from sqlalchemy import select

from loraplex.engine.request import Lane
from loraplex.platform.serving.auth import Authenticator, Principal, parse_lane
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
    assert parse_lane("Batch", "x") == Lane.BATCH and parse_lane(0, "x") == Lane.INTERACTIVE
    assert parse_lane("2", "x") == Lane.BATCH
    for bad in ("fast", 3, -1, True, None, 1.5, "²", "٢", "9" * 5000, 10**5000):
        with pytest.raises(BadRequestError, match="priority"):
            parse_lane(bad, "priority")


def test_failed_keys_are_throttled_per_client_address(db):
    create_tenant(db, "acme")
    key = create_key(db, "acme")
    auth = Authenticator(db, ttl=60, throttle=ThrottleConfig(burst=3, per_second=0.01))

    async def go():
        for i in range(3):
            with pytest.raises(AuthenticationError):
                await auth.authenticate(f"Bearer lpx_0123456789ab_{i}", client="10.1.1.1")
        with pytest.raises(RateLimitedError) as err:
            await auth.authenticate(f"Bearer {key}", client="10.1.1.1")  # refused before any lookup
        assert err.value.retry_after > 1
        assert (await auth.authenticate(f"Bearer {key}", client="10.1.1.2")).tenant == "acme"
        assert (await auth.authenticate(f"Bearer {key}")).tenant == "acme"

    _run(go())


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
        lookups = [asyncio.ensure_future(auth.authenticate(f"Bearer lpx_0123456789a{i}_x")) for i in range(8)]
        await asyncio.sleep(0.05)
        await asyncio.wait_for(auth.ping(), timeout=20)  # answers while the lookups are stuck
        assert not any(f.done() for f in lookups)
        release.set()
        for f in lookups:
            with pytest.raises(AuthenticationError):
                await f
        await auth.close()

    _run(go())
