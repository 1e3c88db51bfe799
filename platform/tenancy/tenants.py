"""Tenants and API keys: creation, listing, revocation, and the key format.

A key reads `lpx_<prefix>_<secret>`: the 12-hex-char prefix is public (it names the key
in listings and in `key revoke`), the secret is 32 random bytes. Only the sha256 of the
whole key is stored; sha256 suffices (no slow KDF) because the secret has 256 bits of
entropy, so there is nothing to brute-force.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import math
import re
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from loraplex.platform.db.database import Database
from loraplex.platform.errors import BadRequestError, ConflictError, NotFoundError
from loraplex.platform.db.base import utcnow
from loraplex.platform.db.tables import ApiKey, Tenant
from loraplex.platform.lanes import LANES, parse_lane_name

KEY_PREFIX = "lpx_"
_PREFIX_HEX = 12
KEY_RE = re.compile(r"^lpx_([0-9a-f]{12})_[A-Za-z0-9_-]{43}$")
TENANT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_prefix(key: str) -> str | None:
    """The visible prefix of a well-formed key, else None."""
    m = KEY_RE.match(key)
    return m.group(1) if m else None


def new_key() -> tuple[str, str]:
    """(key, prefix) for a fresh random key."""
    prefix = secrets.token_hex(_PREFIX_HEX // 2)
    return f"{KEY_PREFIX}{prefix}_{secrets.token_urlsafe(32)}", prefix


def lanes_at_or_below(lane: str) -> tuple[str, ...]:
    return LANES[LANES.index(lane):]


MAX_WEIGHT = 1000.0
MAX_REQUEST_TIMEOUT = 7 * 24 * 3600.0


@dataclass(frozen=True)
class TenantInfo:
    id: int
    name: str
    default_lane: str
    allowed_lanes: tuple[str, ...]
    enabled: bool
    num_keys: int
    weight: float = 1.0
    request_timeout: float | None = None  # seconds; None: the server's default


def parse_weight(value: object) -> float:
    """A tenant's scheduling weight: a finite number in (0, MAX_WEIGHT]."""
    w = _number(value, "weight")
    if not 0 < w <= MAX_WEIGHT:
        raise BadRequestError(f"weight must be a number > 0 and <= {MAX_WEIGHT:g}, got {value!r}", "weight")
    return w


def parse_request_timeout(value: object) -> float | None:
    """Seconds a tenant's request may run; 0 or None: the server's default."""
    if value is None:
        return None
    t = _number(value, "request_timeout")
    if not 0 <= t <= MAX_REQUEST_TIMEOUT:
        raise BadRequestError(f"request_timeout must be between 0 (the server's default) and "
                              f"{MAX_REQUEST_TIMEOUT:g} seconds, got {value!r}", "request_timeout")
    return t or None


def _number(value: object, field: str) -> float:
    try:
        if isinstance(value, bool):
            raise TypeError
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise BadRequestError(f"{field} must be a number, got {value!r}", field) from None
    if not math.isfinite(x):
        raise BadRequestError(f"{field} must be a finite number, got {value!r}", field)
    return x


def create_tenant(db: Database, name: str, lane: str = "standard", allowed: list[str] | None = None,
                  *, weight: float = 1.0, request_timeout: float | None = None) -> TenantInfo:
    if not TENANT_NAME_RE.fullmatch(name or ""):
        raise BadRequestError(f"invalid tenant name {name!r}: use 1-64 letters, digits, '.', '_' or '-'")
    lane, lanes = _lanes(lane, allowed)
    weight, request_timeout = parse_weight(weight), parse_request_timeout(request_timeout)
    try:
        with db.session() as s:
            t = Tenant(name=name, default_lane=lane, allowed_lanes=",".join(lanes), enabled=True,
                       weight=weight, request_timeout=request_timeout)
            s.add(t)
            s.flush()
            return _info(t, 0)
    except IntegrityError:
        raise ConflictError(f"a tenant named {name!r} already exists") from None


def _lanes(lane: str, allowed: list[str] | tuple[str, ...] | None) -> tuple[str, tuple[str, ...]]:
    """(lane, allowed lanes): allowed defaults to the lane and every lower one, may not
    hold a lane above the tenant's, and always holds the tenant's own lane."""
    lane = parse_lane_name(lane)
    lanes = tuple(dict.fromkeys(parse_lane_name(x) for x in allowed)) if allowed else lanes_at_or_below(lane)
    if any(LANES.index(x) < LANES.index(lane) for x in lanes):
        raise BadRequestError(f"allowed lanes may not be above the tenant's lane {lane!r}")
    if lane not in lanes:
        lanes = (lane, *lanes)
    return lane, tuple(sorted(lanes, key=LANES.index))


def _info(t: Tenant, num_keys: int) -> TenantInfo:
    return TenantInfo(t.id, t.name, t.default_lane, t.lanes, t.enabled, num_keys, t.weight, t.request_timeout)


def list_tenants(db: Database) -> list[TenantInfo]:
    with db.session() as s:
        tenants = s.scalars(select(Tenant).order_by(Tenant.name)).all()
        now = utcnow()
        return [_info(t, sum(1 for k in t.keys if _active(k, now))) for t in tenants]


def get_tenant(s, name: str) -> Tenant:
    t = s.scalars(select(Tenant).where(Tenant.name == name)).first()
    if t is None:
        raise NotFoundError(f"no tenant named {name!r}")
    return t


def set_tenant_enabled(db: Database, name: str, enabled: bool) -> None:
    with db.session() as s:
        get_tenant(s, name).enabled = enabled


def _active(k: ApiKey, now: dt.datetime) -> bool:
    return k.revoked_at is None and (k.expires_at is None or k.expires_at > now)


def create_key(db: Database, tenant: str, expires_at: dt.datetime | None = None, name: str | None = None) -> str:
    """Create a key for `tenant`; returns the key itself (the only time it is visible)."""
    with db.session() as s:
        t = get_tenant(s, tenant)
        key, prefix = new_key()
        s.add(ApiKey(tenant_id=t.id, prefix=prefix, secret_hash=hash_key(key), name=name, expires_at=expires_at))
    return key


def revoke_key(db: Database, prefix: str) -> None:
    prefix = prefix.removeprefix(KEY_PREFIX).split("_")[0]
    with db.session() as s:
        k = s.scalars(select(ApiKey).where(ApiKey.prefix == prefix)).first()
        if k is None:
            raise NotFoundError(f"no API key with prefix {prefix!r}")
        if k.revoked_at is None:
            k.revoked_at = utcnow()


def tenant_info(db: Database, name: str) -> TenantInfo:
    with db.session() as s:
        t = get_tenant(s, name)
        now = utcnow()
        return _info(t, sum(1 for k in t.keys if _active(k, now)))


def update_tenant(db: Database, name: str, *, lane: str | None = None, allowed: list[str] | None = None,
                  enabled: bool | None = None, weight: float | None = None,
                  request_timeout: float | None = None) -> TenantInfo:
    """Change a tenant's lane, allowed lanes, enabled flag, weight and/or request timeout
    (None leaves a field as it is; a request timeout of 0 returns to the server's default).
    A new lane without new allowed lanes allows it and every lower one (as at creation)."""
    weight = None if weight is None else parse_weight(weight)
    timeout = None if request_timeout is None else parse_request_timeout(request_timeout)
    with db.session() as s:
        t = get_tenant(s, name)
        if lane is not None or allowed is not None:
            t.default_lane, lanes = _lanes(lane if lane is not None else t.default_lane,
                                           allowed if allowed is not None else (None if lane is not None
                                                                                else list(t.lanes)))
            t.allowed_lanes = ",".join(lanes)
        if enabled is not None:
            t.enabled = enabled
        if weight is not None:
            t.weight = weight
        if request_timeout is not None:
            t.request_timeout = timeout
        s.flush()
        now = utcnow()
        return _info(t, sum(1 for k in t.keys if _active(k, now)))


@dataclass(frozen=True)
class KeyInfo:
    """An API key as listings show it: never the secret, only its visible prefix."""

    prefix: str
    tenant: str
    name: str | None
    created_at: dt.datetime
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    last_used_at: dt.datetime | None

    def status(self, now: dt.datetime | None = None) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= (now or utcnow()):
            return "expired"
        return "active"


def _key_info(k: ApiKey, tenant: str) -> KeyInfo:
    return KeyInfo(k.prefix, tenant, k.name, k.created_at, k.expires_at, k.revoked_at, k.last_used_at)


def list_keys(db: Database, tenant: str | None = None, prefix: str | None = None) -> list[KeyInfo]:
    """Keys, newest first; `prefix` matches the start of the visible prefix ("lpx_" optional)."""
    q = select(ApiKey, Tenant.name).join(Tenant).order_by(ApiKey.created_at.desc(), ApiKey.id.desc())
    with db.session() as s:
        if tenant is not None:
            q = q.where(ApiKey.tenant_id == get_tenant(s, tenant).id)
        if prefix:
            p = prefix.removeprefix(KEY_PREFIX).split("_")[0].lower()
            if not re.fullmatch(r"[0-9a-f]{1,12}", p):
                raise BadRequestError(f"invalid key prefix {prefix!r}: keys read lpx_<12 hex digits>_...", "prefix")
            q = q.where(ApiKey.prefix.startswith(p))
        return [_key_info(k, name) for k, name in s.execute(q).all()]


def key_info(db: Database, prefix: str) -> KeyInfo:
    prefix = prefix.removeprefix(KEY_PREFIX).split("_")[0]
    with db.session() as s:
        row = s.execute(select(ApiKey, Tenant.name).join(Tenant).where(ApiKey.prefix == prefix)).first()
        if row is None:
            raise NotFoundError(f"no API key with prefix {prefix!r}")
        return _key_info(*row)
