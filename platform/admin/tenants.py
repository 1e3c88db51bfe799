"""Admin API handlers: admin sessions, tenants (with their quotas) and API keys."""
from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from loraplex.platform.admin.auth import COOKIE_PATH, CSRF_COOKIE, SESSION_COOKIE, SESSION_SECONDS, Admin
from loraplex.platform.admin.schemas import parse_datetime
from loraplex.platform.quotas.limits import quota_status, set_quota
from loraplex.platform.admin.state import AdminState
from loraplex.platform.http import no_store_json
from loraplex.platform.tenancy.throttle import client_address
from loraplex.platform.errors import AdminAuthenticationError, BadRequestError, RateLimitedError
from loraplex.platform.db.base import utcnow
from loraplex.platform.tenancy.tenants import (
    KEY_PREFIX,
    TenantInfo,
    create_key,
    create_tenant,
    key_info,
    key_prefix,
    list_keys,
    list_tenants,
    revoke_key,
    tenant_info,
    update_tenant,
)

QUOTA_FIELDS = ("rpm", "tpm", "max_concurrency", "token_budget", "budget_period")


# -- serializers ---------------------------------------------------------------------------

def _tenant_json(t: TenantInfo, limits: dict) -> dict:
    return {"name": t.name, "default_lane": t.default_lane, "allowed_lanes": list(t.allowed_lanes),
            "enabled": t.enabled, "num_keys": t.num_keys, "weight": t.weight,
            "request_timeout": t.request_timeout, "quotas": limits}


def _key_json(k, secret: str | None = None) -> dict:
    d = {"prefix": f"{KEY_PREFIX}{k.prefix}", "tenant": k.tenant, "name": k.name, "status": k.status(),
         "created_at": k.created_at, "expires_at": k.expires_at, "revoked_at": k.revoked_at,
         "last_used_at": k.last_used_at}
    if secret is not None:
        d["key"] = secret
    return d


# -- quotas ------------------------------------------------------------------------------------

def _get_quotas(st: AdminState, tenant: str) -> dict:
    """The tenant's limits and where it stands against them now."""
    d = quota_status(st.db, tenant).as_dict()
    d.pop("tenant", None)
    d.pop("key_prefix", None)
    return d


def _set_quotas(st: AdminState, tenant: str, values: dict | None) -> None:
    if values is None:  # null: clear every limit
        values = {f: None for f in QUOTA_FIELDS}
    set_quota(st.db, tenant, **values)


def _quotas_changed(st: AdminState) -> None:
    if st.gateway.hooks is not None:
        st.gateway.hooks.quotas_changed()


# -- handlers: session -----------------------------------------------------------------------

def _session_json(admin: Admin) -> dict:
    return {"actor": admin.actor, "csrf_token": admin.csrf,
            "expires_at": dt.datetime.fromtimestamp(admin.session_expires, dt.timezone.utc)
            if admin.session_expires else None}


async def get_session(request: Request, st: AdminState, admin: Admin, query: dict) -> Any:
    return _session_json(admin)


async def create_session(request: Request, st: AdminState, admin: None, query: dict, body: dict) -> Response:
    client = client_address(request)
    try:
        who = st.auth.check_token(body["token"], client)
    except (AdminAuthenticationError, RateLimitedError) as exc:
        # Refused unchecked (429) from a throttled address is a failed sign-in too.
        st.failures.failed("session.failed", client, str(exc), throttled=isinstance(exc, RateLimitedError))
        raise
    cookie, session = await asyncio.to_thread(st.auth.new_session, who)
    await st.audit(session, "session.create", f"session:{(session.session_id or '')[:12]}", client=client)
    resp = no_store_json(_session_json(session), 201)
    secure = st.settings.secure_cookies or request.url.scheme == "https"
    resp.set_cookie(SESSION_COOKIE, cookie, max_age=SESSION_SECONDS, path=COOKIE_PATH, httponly=True,
                    samesite="strict", secure=secure)
    resp.set_cookie(CSRF_COOKIE, session.csrf or "", max_age=SESSION_SECONDS, path=COOKIE_PATH, httponly=False,
                    samesite="strict", secure=secure)
    return resp


async def delete_session(request: Request, st: AdminState, admin: Admin, query: dict) -> Response:
    if admin.session_id:
        await asyncio.to_thread(st.auth.sign_out, admin)
        await st.audit(admin, "session.delete", f"session:{admin.session_id[:12]}")
    resp = Response(status_code=204, headers={"Cache-Control": "no-store"})
    for name in (SESSION_COOKIE, CSRF_COOKIE):
        resp.delete_cookie(name, path=COOKIE_PATH, samesite="strict")
    return resp


# -- handlers: tenants -----------------------------------------------------------------------

async def list_tenants_(request: Request, st: AdminState, admin: Admin, query: dict) -> Any:
    def load():
        return [_tenant_json(t, _get_quotas(st, t.name)) for t in list_tenants(st.db)]

    return await asyncio.to_thread(load)


async def get_tenant_(request: Request, st: AdminState, admin: Admin, query: dict, name: str) -> Any:
    def load():
        return _tenant_json(tenant_info(st.db, name), _get_quotas(st, name))

    return await asyncio.to_thread(load)


async def create_tenant_(request: Request, st: AdminState, admin: Admin, query: dict, body: dict) -> Any:
    def make():
        t = create_tenant(st.db, body["name"], body.get("default_lane", "standard"), body.get("allowed_lanes"),
                          weight=body.get("weight", 1.0), request_timeout=body.get("request_timeout"))
        if body.get("quotas"):
            _set_quotas(st, t.name, body["quotas"])
        return t, _get_quotas(st, t.name)

    t, limits = await asyncio.to_thread(make)
    _quotas_changed(st)
    await st.audit(admin, "tenant.create", f"tenant:{t.name}", default_lane=t.default_lane,
                   allowed_lanes=list(t.allowed_lanes), weight=t.weight, request_timeout=t.request_timeout,
                   **({"quotas": body["quotas"]} if body.get("quotas") else {}))
    return _tenant_json(t, limits)


async def update_tenant_(request: Request, st: AdminState, admin: Admin, query: dict, body: dict,
                         name: str) -> Any:
    def change():
        before = tenant_info(st.db, name)
        # request_timeout null clears it (0 to update_tenant); absent leaves it.
        timeout = (body["request_timeout"] or 0) if "request_timeout" in body else None
        t = update_tenant(st.db, name, lane=body.get("default_lane"), allowed=body.get("allowed_lanes"),
                          enabled=body.get("enabled"), weight=body.get("weight"), request_timeout=timeout)
        if "quotas" in body:
            _set_quotas(st, name, body["quotas"])
        return before, t, _get_quotas(st, name)

    before, t, limits = await asyncio.to_thread(change)
    st.access_changed()
    _quotas_changed(st)
    changes: dict[str, Any] = {}
    if (before.default_lane, before.allowed_lanes) != (t.default_lane, t.allowed_lanes):
        changes["lanes"] = {"from": [before.default_lane, list(before.allowed_lanes)],
                            "to": [t.default_lane, list(t.allowed_lanes)]}
    if before.enabled != t.enabled:
        changes["enabled"] = t.enabled
    for field in ("weight", "request_timeout"):
        if getattr(before, field) != getattr(t, field):
            changes[field] = {"from": getattr(before, field), "to": getattr(t, field)}
    if "quotas" in body:
        changes["quotas"] = body["quotas"]
    action = ("tenant.disable" if changes.get("enabled") is False else
              "tenant.enable" if changes.get("enabled") is True and len(changes) == 1 else "tenant.update")
    await st.audit(admin, action, f"tenant:{name}", **changes)
    return _tenant_json(t, limits)


# -- handlers: keys --------------------------------------------------------------------------

async def list_keys_(request: Request, st: AdminState, admin: Admin, query: dict) -> Any:
    keys = await asyncio.to_thread(list_keys, st.db, query.get("tenant"), query.get("prefix"))
    if query.get("status"):
        keys = [k for k in keys if k.status() == query["status"]]
    return [_key_json(k) for k in keys[: query.get("limit", 500)]]


async def create_key_(request: Request, st: AdminState, admin: Admin, query: dict, body: dict) -> Any:
    expires = None
    if body.get("expires_at") is not None:
        expires = parse_datetime(body["expires_at"], "expires_at")
    elif body.get("expires_in_days") is not None:
        expires = utcnow() + dt.timedelta(days=body["expires_in_days"])
    if expires is not None and expires <= utcnow():
        raise BadRequestError("expires_at: must be in the future", "expires_at")

    def make():
        secret = create_key(st.db, body["tenant"], expires, body.get("name"))
        return secret, key_info(st.db, key_prefix(secret) or "")

    secret, info = await asyncio.to_thread(make)
    await st.audit(admin, "key.create", f"key:{KEY_PREFIX}{info.prefix}", tenant=info.tenant, name=info.name,
                   expires_at=info.expires_at.isoformat() if info.expires_at else None)
    return _key_json(info, secret)


async def revoke_key_(request: Request, st: AdminState, admin: Admin, query: dict, prefix: str) -> Any:
    def revoke():
        before = key_info(st.db, prefix)
        revoke_key(st.db, before.prefix)
        return before, key_info(st.db, before.prefix)

    before, info = await asyncio.to_thread(revoke)
    st.access_changed()
    if before.revoked_at is None:
        await st.audit(admin, "key.revoke", f"key:{KEY_PREFIX}{info.prefix}", tenant=info.tenant)
    return _key_json(info)
