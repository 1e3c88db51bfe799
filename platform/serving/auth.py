"""Bearer API key -> Principal, with a short in-process cache.

Cost per request on a cache hit: one sha256 and one dict lookup; no database access.

Bounded staleness (documented contract): a validated key is trusted for
`Settings.auth.cache_ttl` seconds (default 5). A key revoked, a tenant disabled, or an
adapter grant changed by another process (the CLI, another replica) therefore takes
effect within that many seconds. Expiry (`expires_at`) is checked on every request
and is exact. Unknown keys are remembered for `Settings.auth.negative_ttl` seconds so a flood of
bad keys cannot hammer the database; a key created meanwhile is unaffected (it is new).
Failed attempts are throttled per client address (tenancy/throttle.py), but many tenants
may share an address (a proxy's), so a throttled address is never refused a valid key:
past its burst, a key that is not cached and whose digest is not among the keys the
database holds (tenancy/known_keys.py, refreshed every `cache_ttl` seconds, at
least every `MIN_KNOWN_KEYS_REFRESH`) gets 429 without a database query, and a
malformed one without even a hash. Lookups run on their own small thread pool, so a
flood of unknown keys never delays `/ready` or other database work;
`ping()` (readiness) has a thread of its own.

`last_used_at` is recorded in memory (a set of key ids) and written in one UPDATE for all
keys used, every `Settings.auth.last_used_flush_seconds` (and at shutdown), never per request; the
stored time is therefore accurate to that interval.
"""
from __future__ import annotations

import asyncio
import datetime as dt
from concurrent.futures import ThreadPoolExecutor
import hmac
import logging
import time
from dataclasses import dataclass

from sqlalchemy import select, update

from loraplex.platform.lanes import Lane, lane_name, stored_lane

from loraplex.platform.tenancy.adapter_registry import adapters_for_tenant
from loraplex.platform.db.database import Database
from loraplex.platform.errors import AuthenticationError, PermissionDeniedError, RateLimitedError
from loraplex.platform.db.base import utcnow
from loraplex.platform.db.tables import ApiKey, Tenant
from loraplex.platform.tenancy.known_keys import KnownKeys
from loraplex.platform.tenancy.tenants import hash_key, key_prefix
from loraplex.platform.tenancy.throttle import FailureThrottle, ThrottleConfig

log = logging.getLogger(__name__)
_MAX_CACHE = 100_000
# Database lookups of keys not in the cache run on this many threads of their own.
AUTH_THREADS = 2
# With the auth cache off (ttl 0), the set of known keys is still refreshed this often.
MIN_KNOWN_KEYS_REFRESH = 1.0


@dataclass(frozen=True)
class Principal:
    tenant_id: int
    tenant: str
    key_id: int
    key_prefix: str
    lane: Lane  # the tenant's lane: requests get it unless they ask for a lower one
    allowed_lanes: frozenset[Lane]
    adapters: frozenset[str]  # adapter names this tenant may use
    expires_at: float | None = None  # unix seconds
    # Tenant-fair scheduling: its weight, and its own request timeout (None: the server's).
    weight: float = 1.0
    request_timeout: float | None = None

    def lane_for(self, requested: Lane | None) -> Lane:
        """The lane a request runs in; asking for a higher one than the tenant's is a 403."""
        if requested is None or requested == self.lane:
            return self.lane
        if requested < self.lane:
            raise PermissionDeniedError(
                f"lane {lane_name(requested)!r} is above this tenant's lane {lane_name(self.lane)!r}; "
                "a request may only ask for a lower lane")
        if requested not in self.allowed_lanes:
            raise PermissionDeniedError(f"lane {lane_name(requested)!r} is not allowed for this tenant")
        return requested


class Authenticator:
    def __init__(self, db: Database, ttl: float = 5.0, negative_ttl: float = 2.0,
                 flush_seconds: float = 30.0, throttle: ThrottleConfig = ThrottleConfig()) -> None:
        self.db = db
        self.throttle = FailureThrottle(throttle)
        self._pool = ThreadPoolExecutor(AUTH_THREADS, thread_name_prefix="loraplex-auth")
        self._ping_pool = ThreadPoolExecutor(1, thread_name_prefix="loraplex-ready")
        self.ttl, self.negative_ttl, self.flush_seconds = ttl, negative_ttl, flush_seconds
        self._cache: dict[str, tuple[Principal, float]] = {}
        self._negative: dict[str, float] = {}
        self._inflight: dict[str, asyncio.Future] = {}
        self._used: set[int] = set()  # key ids used since the last flush
        self._flusher: asyncio.Task | None = None
        self.known = KnownKeys(db)
        self._refresher: asyncio.Task | None = None

    async def authenticate(self, authorization: str | None, client: str | None = None) -> Principal:
        """The caller's Principal; `client` (its address) is throttled after failures,
        which refuses only keys that do not exist."""
        wait = self.throttle.retry_after(client) if client is not None else 0.0
        try:
            return await self._authenticate(authorization, wait)
        except AuthenticationError:
            if client is not None:
                self.throttle.failed(client)
            raise

    @staticmethod
    def _refuse(wait: float, error: str) -> AuthenticationError | RateLimitedError:
        """401 naming what is wrong, or 429 when the address is throttled."""
        if wait > 0:
            return RateLimitedError("too many failed authentication attempts from this address", wait)
        return AuthenticationError(error)

    async def _authenticate(self, authorization: str | None, wait: float = 0.0) -> Principal:
        if not authorization or not authorization[:7].lower() == "bearer ":
            raise self._refuse(wait, "Missing API key: send 'Authorization: Bearer <key>'.")
        key = authorization[7:].strip()
        if key_prefix(key) is None:  # no key has this shape: no hash, no query
            raise self._refuse(wait, "Invalid API key.")
        digest = hash_key(key)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[1] > now:
            principal = hit[0]
        else:
            if wait > 0 and self.known.loaded and digest not in self.known:
                raise self._refuse(wait, "Invalid API key.")
            principal = await self._lookup(key, digest, now)
        if principal.expires_at is not None and principal.expires_at <= time.time():
            raise AuthenticationError("Invalid API key: this key has expired.")
        self._used.add(principal.key_id)
        return principal

    async def _lookup(self, key: str, digest: str, now: float) -> Principal:
        if self._negative.get(digest, 0.0) > now:
            raise AuthenticationError("Invalid API key.")
        fut = self._inflight.get(digest)
        if fut is None:  # one database lookup per key at a time, however many requests wait
            fut = asyncio.get_running_loop().run_in_executor(self._pool, self._load, key, digest)
            self._inflight[digest] = fut
            fut.add_done_callback(lambda _f: self._inflight.pop(digest, None))
        principal = await asyncio.shield(fut)
        if len(self._cache) >= _MAX_CACHE:
            self._cache.clear()
        if len(self._negative) >= _MAX_CACHE:
            self._negative.clear()
        if principal is None:
            self._negative[digest] = time.monotonic() + self.negative_ttl
            raise AuthenticationError("Invalid API key.")
        if isinstance(principal, AuthenticationError):
            raise principal
        self._cache[digest] = (principal, time.monotonic() + self.ttl)
        self.known.add(digest)
        return principal

    def _load(self, key: str, digest: str) -> Principal | AuthenticationError | None:
        prefix = key_prefix(key)
        if prefix is None:
            return None
        with self.db.session() as s:
            row = s.execute(select(ApiKey, Tenant).join(Tenant).where(ApiKey.prefix == prefix)).first()
            if row is None or not hmac.compare_digest(row.ApiKey.secret_hash, digest):
                return None
            k, t = row.ApiKey, row.Tenant
            if k.revoked_at is not None:
                return AuthenticationError("Invalid API key: this key has been revoked.")
            if not t.enabled:
                return AuthenticationError("Invalid API key: this key's tenant is disabled.")
            lane = stored_lane(t.default_lane)
            lanes = frozenset(stored_lane(x) for x in t.lanes) | {lane}
            return Principal(t.id, t.name, k.id, k.prefix, lane, lanes, frozenset(adapters_for_tenant(s, t.id)),
                             k.expires_at.timestamp() if k.expires_at else None, t.weight, t.request_timeout)

    async def ping(self) -> None:
        """Reach the database on a thread no other work queues on (readiness)."""
        await asyncio.get_running_loop().run_in_executor(self._ping_pool, self.db.ping)

    def invalidate(self) -> None:
        """Forget every cached principal (tests, admin changes made in this process)."""
        self._cache.clear()
        self._negative.clear()

    # -- last_used_at ----------------------------------------------------------------
    def start(self) -> None:
        if self.flush_seconds > 0 and self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_loop())
        if self._refresher is None:
            self._refresher = asyncio.create_task(self._refresh_loop())

    async def refresh_known_keys(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, self.known.refresh)

    async def _refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh_known_keys()
            except Exception:  # a DB hiccup: keep the last set, try again next round
                log.exception("refreshing the known API keys failed")
            await asyncio.sleep(max(self.ttl, MIN_KNOWN_KEYS_REFRESH))

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_seconds)
            try:
                await self.flush_last_used()
            except Exception:  # a DB hiccup must not kill the loop; next round retries
                log.exception("flushing api key last_used_at failed")

    async def flush_last_used(self) -> None:
        used, self._used = self._used, set()
        if used:  # stamped at flush time: accurate to flush_seconds
            await asyncio.to_thread(self._write_last_used, sorted(used), utcnow())

    def _write_last_used(self, key_ids: list[int], when: dt.datetime) -> None:
        with self.db.session() as s:
            s.execute(update(ApiKey).where(ApiKey.id.in_(key_ids)).values(last_used_at=when))

    async def close(self) -> None:
        for task in (self._flusher, self._refresher):
            if task is not None:
                task.cancel()
        self._flusher = self._refresher = None
        try:
            await self.flush_last_used()
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._ping_pool.shutdown(wait=False, cancel_futures=True)

