"""The admin API (JSON under /admin/api) and the admin UI's static files (under /admin).

Every operation is declared once in `OPS` (route, handler, OpenAPI description); the
document is served at /admin/api/openapi.json. Authentication and CSRF: admin/auth.py.
Errors: platform/errors.py (the same `{"error": {...}}` body as the OpenAI routes).

Every change writes one audit row (tenancy/audit.py) naming the admin credential that made it.
Changes to who may use what (keys revoked, tenants disabled, grants) take effect at once
in this process (its key cache is cleared) and within `Settings.auth.cache_ttl` on other replicas.

Adapter uploads stream to a private staging folder with a size limit, are validated in
full by the adapter store, and are published atomically: an adapter is visible (to the
engine and in listings) only once complete and valid; a bad upload changes nothing.

The handlers live beside it: state.py (AdminState, shared helpers), tenants.py
(sessions, tenants, keys, quotas), adapters.py and uploads.py (adapters), usage.py
(engine, audit, usage), ui.py (the UI's static files).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from loraplex.adapters import AdapterNotFoundError
from loraplex.adapters.features import TAG_PATTERN

from loraplex.platform.admin.adapters import (
    get_adapter_,
    grant_adapter_,
    list_adapters_,
    remove_adapter_,
    replace_adapter,
    revoke_grant_,
    update_adapter_,
    upload_adapter,
)
from loraplex.platform.admin.ui import ui_asset, ui_index, ui_redirect
from loraplex.platform.admin.auth import CSRF_HEADER, SESSION_COOKIE, Admin
from loraplex.platform.admin.schemas import Op, check_query, check_text, openapi_document, qparam, validate
from loraplex.platform.admin.state import AdminState
from loraplex.platform.http import no_store_json
from loraplex.platform.tenancy.throttle import client_address
from loraplex.platform.admin.tenants import (
    create_key_,
    create_session,
    create_tenant_,
    delete_session,
    get_session,
    get_tenant_,
    list_keys_,
    list_tenants_,
    revoke_key_,
    update_tenant_,
)
from loraplex.platform.admin.usage import (
    SERIES_FIELDS,
    BASE_MODEL_KEY,
    engine_status,
    list_audit,
    usage_export,
    usage_series,
)
from loraplex.platform.errors import (
    AdminAuthenticationError,
    BadRequestError,
    NotFoundError,
    RateLimitedError,
    UnsupportedMediaTypeError,
    api_error,
    error_response,
)
from loraplex.platform.lanes import LANES
from loraplex.platform.serving.request_limits import check_content_length, parse_json_object, read_body
from loraplex.platform.settings import ServerLimits
from loraplex.platform.tenancy.tenants import MAX_REQUEST_TIMEOUT, MAX_WEIGHT

log = logging.getLogger(__name__)
API_VERSION = "1"


def _state(request: Request) -> AdminState:
    return request.app.state.admin


def _body_limit(st: AdminState, op: Op) -> int:
    """JSON bodies are small; the one a caller sends before proving anything, smaller."""
    limits = st.settings.limits
    return limits.max_admin_body_bytes if op.auth else limits.max_sign_in_body_bytes


async def _json_body(request: Request, schema: dict, limit: int, limits: ServerLimits) -> dict:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise UnsupportedMediaTypeError("send the request body as JSON (Content-Type: application/json)")
    raw = await read_body(request, limit)
    if not raw:
        raise BadRequestError("the request body must be a JSON object")
    body = parse_json_object(raw, limits)
    validate(schema, body, "body")
    return body


async def _authenticate(st: AdminState, request: Request) -> Admin:
    """The caller (a session is a database row: checked off the event loop). A wrong Bearer
    token, and one refused unchecked (429) from a throttled address, is audited, aggregated
    per window (admin/failed_auth.py)."""
    bearer = request.headers.get("authorization")
    client = client_address(request)
    try:
        return await asyncio.to_thread(st.auth.authenticate, request.method, bearer,
                                       request.cookies.get(SESSION_COOKIE), request.headers.get(CSRF_HEADER), client)
    except (AdminAuthenticationError, RateLimitedError) as exc:
        if bearer:
            st.failures.failed("admin.bearer_failed", client, str(exc), throttled=isinstance(exc, RateLimitedError))
        raise


def _endpoint(op: Op):
    async def endpoint(request: Request) -> Response:
        try:
            st = _state(request)
            admin = None
            if op.body is not None:  # refused from its declared size alone, before any other work
                check_content_length(request, _body_limit(st, op))
            if op.auth:
                admin = await _authenticate(st, request)
            for name, value in request.path_params.items():
                check_text(value, name)
            args: dict[str, Any] = {"query": check_query(op, request.query_params)}
            if op.body is not None:
                args["body"] = await _json_body(request, op.body, _body_limit(st, op), st.settings.limits)
            result = await op.handler(request, st, admin, **request.path_params, **args)
        except Exception as exc:  # noqa: BLE001 - mapped to a status in one place
            if isinstance(exc, AdapterNotFoundError):
                exc = NotFoundError(str(exc))
            err = api_error(exc)
            if err.status == 500:
                log.exception("unhandled error in admin API %s %s", op.method, op.path)
            resp = error_response(err)
            resp.headers["Cache-Control"] = "no-store"
            return resp
        if isinstance(result, Response):
            return result
        return no_store_json(result, op.ok)

    endpoint.__name__ = op.operation_id
    return endpoint


async def get_openapi(request: Request, st: AdminState, admin: None, query: dict) -> Any:
    return request.app.state.admin_openapi


# -- the table ------------------------------------------------------------------------------

LANE = {"type": "string", "enum": list(LANES)}
NAME = {"type": "string", "minLength": 1, "maxLength": 64, "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        "description": "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"}
TS = {"type": ["string", "null"], "format": "date-time"}
ISO_TIME = {"type": "string", "maxLength": 40,
            "pattern": r"^\d{4}-\d{2}-\d{2}([Tt ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?([Zz]|[+-]\d{2}:?\d{2})?)?$",
            "description": "an ISO date (UTC midnight) or date-time"}
# The database's integer columns: 32-bit, the token budget 64-bit.
INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
_LIMIT = {"type": ["integer", "null"], "minimum": 0, "maximum": INT32_MAX}
QUOTAS_IN = {"type": ["object", "null"], "additionalProperties": False,
             "description": "Limits to set; a field left out keeps its value, null clears it (null: clear all)",
             "properties": {"rpm": {**_LIMIT, "description": "requests per minute"},
                            "tpm": {**_LIMIT, "description": "tokens per minute (prompt + max_tokens reserved)"},
                            "max_concurrency": {**_LIMIT, "description": "requests in flight at once"},
                            "token_budget": {**_LIMIT, "maximum": INT64_MAX,
                                             "description": "tokens per budget period"},
                            "budget_period": {"type": ["string", "null"], "enum": ["day", "month", None]}}}
QUOTAS = {"type": "object", "description": "The tenant's limits (null fields: no limit) and where it "
          "stands now",
          "properties": {**QUOTAS_IN["properties"],
                         "requests_this_minute": {"type": "integer"}, "tokens_this_minute": {"type": "integer"},
                         "in_flight": {"type": "integer"}, "budget_used": {"type": "integer"},
                         "budget_remaining": {"type": ["integer", "null"]},
                         "budget_period_start": TS, "budget_period_end": TS, "updated_at": TS}}
_POINT = {"type": "object", "required": ["t", "total_tokens"], "properties": {
    "t": {"type": "string", "format": "date-time"}, **{f: {"type": "integer"} for f in SERIES_FIELDS}}}

WEIGHT = {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_WEIGHT,
          "description": "its share of the engine inside a lane and of the waiting queue, relative to other "
                         "tenants (tenant-fair scheduling; default 1)"}
FEATURES = {"type": ["array", "null"], "items": {"type": "string", "pattern": TAG_PATTERN},
            "description": "the version's kind: the PEFT features it uses beyond plain LoRA, as tags: rslora, "
                           "dora, lora_bias, trainable_tokens:<modules>, modules_to_save:<modules> (modules "
                           "comma-separated); [] plain LoRA; null unknown (recorded before kinds were)"}
REQUEST_TIMEOUT = {"type": ["number", "null"], "minimum": 0, "maximum": MAX_REQUEST_TIMEOUT,
                   "description": "seconds a request may run before the engine ends it (finish reason "
                                  "timeout); null or 0: the server's --request-timeout"}

COMPONENTS: dict[str, dict] = {
    "Session": {"type": "object", "required": ["actor", "csrf_token"], "properties": {
        "actor": {"type": "string"}, "csrf_token": {"type": ["string", "null"]}, "expires_at": TS}},
    "Tenant": {"type": "object", "required": ["name", "default_lane", "allowed_lanes", "enabled", "num_keys"],
               "properties": {"name": {"type": "string"}, "default_lane": LANE,
                              "allowed_lanes": {"type": "array", "items": LANE}, "enabled": {"type": "boolean"},
                              "num_keys": {"type": "integer", "description": "active keys"}, "quotas": QUOTAS,
                              "weight": WEIGHT, "request_timeout": REQUEST_TIMEOUT}},
    "Key": {"type": "object", "required": ["prefix", "tenant", "status", "created_at"], "properties": {
        "prefix": {"type": "string", "description": "the key's visible part, lpx_<12 hex>"},
        "tenant": {"type": "string"}, "name": {"type": ["string", "null"]},
        "status": {"type": "string", "enum": ["active", "expired", "revoked"]},
        "created_at": {"type": "string", "format": "date-time"}, "expires_at": TS, "revoked_at": TS,
        "last_used_at": TS}},
    "AdapterVersion": {"type": "object", "required": ["digest", "rank", "size_bytes", "features", "residency"],
                       "properties": {
        "digest": {"type": "string"}, "rank": {"type": "integer"}, "alpha": {"type": "number"},
        "target_modules": {"type": "array", "items": {"type": "string"}}, "size_bytes": {"type": "integer"},
        "features": FEATURES, "created_at": {"type": "string", "format": "date-time"},
        "residency": {"type": "string", "enum": ["device", "cpu", "disk"]}}},
    "Adapter": {"type": "object", "required": ["name", "digest", "public", "grants", "features", "residency"],
                "properties": {
        "name": {"type": "string"}, "digest": {"type": "string", "description": "sha256:... of the current version"},
        "public": {"type": "boolean"}, "owner": {"type": ["string", "null"]},
        "grants": {"type": "array", "items": {"type": "string"}},
        "rank": {"type": ["integer", "null"]}, "alpha": {"type": ["number", "null"]},
        "target_modules": {"type": "array", "items": {"type": "string"}},
        "size_bytes": {"type": ["integer", "null"]}, "features": FEATURES, "created_at": TS, "updated_at": TS,
        "residency": {"type": "string", "enum": ["device", "cpu", "disk", "store", "missing"],
                      "description": "where the current version is now: a device slot, the CPU tier, this "
                                     "server's disk, only the shared adapter store (uploaded through another "
                                     "gateway; workers fetch it from there), or nowhere"},
        "versions": {"type": "array", "items": {"$ref": "#/components/schemas/AdapterVersion"},
                     "description": "(one adapter) the current version first, then older ones still kept"},
        "num_versions": {"type": "integer", "description": "(listings) versions kept, the current one included"}}},
    "Engine": {"type": "object", "required": ["model", "running", "lanes", "kv_cache_usage", "resident_adapters"],
               "properties": {
                   "model": {"type": "string"}, "running": {"type": "boolean"}, "device": {"type": "string"},
                   "num_running": {"type": "integer"}, "num_waiting": {"type": "integer"},
                   "lanes": {"type": "object", "additionalProperties": {
                       "type": "object", "properties": {"running": {"type": "integer"},
                                                        "waiting": {"type": "integer"}}}},
                   "kv_cache_usage": {"type": "number", "description": "fraction of KV blocks in use, 0..1"},
                   "num_kv_blocks": {"type": ["integer", "null"]}, "block_size": {"type": "integer"},
                   "num_preemptions": {"type": "integer"}, "prefix_cache_queries": {"type": "integer"},
                   "prefix_cache_hits": {"type": "integer"}, "max_loras": {"type": "integer"},
                   "max_cpu_loras": {"type": "integer"}, "stats_time": TS,
                   "resident_adapters": {"type": "array", "items": {"type": "object", "properties": {
                       "digest": {"type": "string"}, "tier": {"type": "string", "enum": ["device", "cpu"]},
                       "names": {"type": "array", "items": {"type": "string"}}}}}}},
    "Usage": {"type": "object", "required": ["from", "to", "granularity", "group_by", "series"], "properties": {
        "from": {"type": "string", "format": "date-time"}, "to": {"type": "string", "format": "date-time"},
        "granularity": {"type": "string"}, "group_by": {"type": "string"},
        "series": {"type": "array", "items": {"type": "object", "required": ["key", "points"], "properties": {
            "key": {"type": "string", "description": f"tenant or adapter name; {BASE_MODEL_KEY!r} for the base model"},
            "totals": {"type": "object"}, "points": {"type": "array", "items": _POINT}}}}}},
    "AuditEntry": {"type": "object", "required": ["id", "at", "actor", "action", "target", "details"], "properties": {
        "id": {"type": "integer"}, "at": {"type": "string", "format": "date-time"}, "actor": {"type": "string"},
        "action": {"type": "string"}, "target": {"type": "string"}, "details": {"type": "object"}}},
}


def _list_of(name: str) -> dict:
    return {"type": "array", "items": {"$ref": f"#/components/schemas/{name}"}}


UPLOAD_FILES = {"type": "array", "minItems": 1, "maxItems": 2,
                "items": {"type": "string", "contentMediaType": "application/octet-stream"},
                "description": "adapter_config.json and adapter_model.safetensors, or one .zip of the adapter folder"}

OPS: list[Op] = [
    Op("GET", "/openapi.json", get_openapi, "This document", "meta", out={"type": "object"}, auth=False),
    Op("GET", "/session", get_session, "Who is signed in (and the session's CSRF token)", "session", out="Session"),
    Op("POST", "/session", create_session, "Sign in with the admin token: sets the session cookie", "session",
       ok=201, out="Session", auth=False, errors=(401,),
       body={"type": "object", "required": ["token"], "additionalProperties": False,
             "properties": {"token": {"type": "string", "minLength": 1, "maxLength": 512}}}),
    Op("DELETE", "/session", delete_session, "Sign out", "session", ok=204),
    Op("GET", "/tenants", list_tenants_, "List tenants", "tenants", out=_list_of("Tenant")),
    Op("POST", "/tenants", create_tenant_, "Create a tenant", "tenants", ok=201, out="Tenant", errors=(409,),
       body={"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
           "name": NAME, "default_lane": LANE,
           "allowed_lanes": {"type": "array", "items": LANE, "minItems": 1, "uniqueItems": True},
           "weight": WEIGHT, "request_timeout": REQUEST_TIMEOUT, "quotas": QUOTAS_IN}}),
    Op("GET", "/tenants/{name}", get_tenant_, "One tenant", "tenants", out="Tenant"),
    Op("PATCH", "/tenants/{name}", update_tenant_,
       "Change a tenant's lanes, weight, request timeout or quotas, or disable/enable it", "tenants", out="Tenant",
       body={"type": "object", "additionalProperties": False, "minProperties": 1, "properties": {
           "default_lane": LANE, "allowed_lanes": {"type": "array", "items": LANE, "minItems": 1, "uniqueItems": True},
           "enabled": {"type": "boolean"}, "weight": WEIGHT, "request_timeout": REQUEST_TIMEOUT,
           "quotas": QUOTAS_IN}}),
    Op("GET", "/keys", list_keys_, "List API keys (never their secrets), newest first", "keys", out=_list_of("Key"),
       errors=(404,),
       query=[qparam("tenant", {"type": "string", "minLength": 1, "maxLength": 64}, "only this tenant's keys"),
              qparam("prefix", {"type": "string", "pattern": r"^(lpx_)?[0-9a-f]{1,12}$"},
                     "keys whose prefix starts so"),
              qparam("status", {"type": "string", "enum": ["active", "expired", "revoked"]}),
              qparam("limit", {"type": "integer", "minimum": 1, "maximum": 5000})]),
    Op("POST", "/keys", create_key_, "Create an API key: the response holds the key itself, shown this once",
       "keys", ok=201, errors=(404,),
       out={"allOf": [{"$ref": "#/components/schemas/Key"},
                      {"type": "object", "required": ["key"], "properties": {"key": {"type": "string"}}}]},
       body={"type": "object", "required": ["tenant"], "additionalProperties": False, "properties": {
           "tenant": {"type": "string", "minLength": 1, "maxLength": 64},
           "name": {"type": ["string", "null"], "maxLength": 128},
           "expires_in_days": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 36500},
           "expires_at": {"type": ["string", "null"], "format": "date-time"}}}),
    Op("DELETE", "/keys/{prefix}", revoke_key_, "Revoke an API key by its prefix", "keys", out="Key"),
    Op("GET", "/adapters", list_adapters_, "List adapters with rank, targets, size, digest, access and residency",
       "adapters", out=_list_of("Adapter")),
    Op("POST", "/adapters", upload_adapter, "Upload a new PEFT LoRA adapter (validated, then published at once)",
       "adapters", ok=201, out="Adapter", errors=(400, 404, 409, 413, 415),
       multipart={"type": "object", "required": ["name", "files"], "properties": {
           "name": NAME, "public": {"type": "boolean"},
           "owner": {"type": "string", "description": "the tenant that owns it"},
           "grants": {"type": "string", "description": "comma-separated tenants to grant it to"},
           "files": UPLOAD_FILES}}),
    Op("GET", "/adapters/{name}", get_adapter_, "One adapter, with its kept versions", "adapters", out="Adapter"),
    Op("PATCH", "/adapters/{name}", update_adapter_, "Make an adapter public or private, or change its owner",
       "adapters", out="Adapter",
       body={"type": "object", "additionalProperties": False, "minProperties": 1, "properties": {
           "public": {"type": "boolean"}, "owner": {"type": ["string", "null"], "maxLength": 64}}}),
    Op("DELETE", "/adapters/{name}", remove_adapter_, "Remove an adapter (every version)", "adapters",
       out={"type": "object", "properties": {"name": {"type": "string"}, "digest": {"type": "string"},
                                             "removed": {"type": "boolean"}}}),
    Op("POST", "/adapters/{name}/versions", replace_adapter, "Replace an adapter with a new version", "adapters",
       out="Adapter", errors=(413, 415),
       multipart={"type": "object", "required": ["files"], "properties": {"files": UPLOAD_FILES}}),
    Op("PUT", "/adapters/{name}/grants/{tenant}", grant_adapter_, "Grant an adapter to a tenant", "adapters",
       out="Adapter"),
    Op("DELETE", "/adapters/{name}/grants/{tenant}", revoke_grant_, "Take a tenant's grant away", "adapters",
       out="Adapter"),
    Op("GET", "/engine", engine_status, "Engine: running/waiting per lane, KV cache use, resident adapters",
       "engine", out="Engine"),
    Op("GET", "/usage", usage_series, "Tokens over time per tenant or per adapter (from the hourly rollups)",
       "usage", out="Usage", errors=(404,),
       query=[qparam("group_by", {"type": "string", "enum": ["tenant", "adapter"]}, "one series per tenant "
                     "(default) or per adapter"),
              qparam("granularity", {"type": "string", "enum": ["hour", "day"]}, "default hour"),
              qparam("from", ISO_TIME,
                     "start (ISO date or date-time, UTC), on a period boundary; default 24 periods before `to`"),
              qparam("to", ISO_TIME, "end (exclusive); default now"),
              qparam("tenant", {"type": "string", "minLength": 1, "maxLength": 64}),
              qparam("adapter", {"type": "string", "maxLength": 64}, "an adapter name; empty: the base model")]),
    Op("GET", "/usage/export", usage_export, "Export usage for billing: CSV, JSON lines or CloudEvents",
       "usage", errors=(404,),
       produces={"text/csv": {"type": "string"}, "application/x-ndjson": {"type": "string"},
                 "application/cloudevents-batch+json": {"type": "string"}},
       query=[qparam("format", {"type": "string", "enum": ["csv", "jsonl", "cloudevents"]}, "default csv"),
              qparam("granularity", {"type": "string", "enum": ["event", "hour", "day"]},
                     "one record per request (default) or per tenant, adapter and hour/day"),
              qparam("from", ISO_TIME, "start (ISO date or date-time, UTC); default 24 hours before `to`"),
              qparam("to", ISO_TIME, "end (exclusive); default the end of this hour"),
              qparam("tenant", {"type": "string", "minLength": 1, "maxLength": 64})]),
    Op("GET", "/audit", list_audit, "The audit log, newest first", "audit", out=_list_of("AuditEntry"),
       query=[qparam("limit", {"type": "integer", "minimum": 1, "maximum": 1000}),
              qparam("before", {"type": "integer", "minimum": 1, "maximum": INT32_MAX}, "entries with a smaller id (paging)"),
              qparam("action", {"type": "string", "minLength": 1, "maxLength": 64}),
              qparam("target", {"type": "string", "minLength": 1, "maxLength": 200})]),
]

DESCRIPTION = """Manage a loraplex server: tenants, API keys, adapters, usage, and the engine.

Authenticate with the admin token (`Authorization: Bearer <token>`), or sign in
(`POST /admin/api/session`) for a session cookie; changes made with the cookie also need
the session's CSRF token in `X-CSRF-Token`. Every change is written to the audit log."""


PATH_PARAMS = {"name": NAME, "tenant": NAME,
               "prefix": {"type": "string", "pattern": r"^(lpx_)?[0-9a-f]{12}$",
                          "description": "a key's visible prefix, lpx_<12 hex digits>"}}


def openapi() -> dict:
    return openapi_document(OPS, COMPONENTS, title="loraplex admin API", version=API_VERSION,
                            description=DESCRIPTION, path_params=PATH_PARAMS)


def _dispatch(endpoints: dict[str, Any]):
    async def endpoint(request: Request) -> Response:
        method = "GET" if request.method == "HEAD" else request.method
        return await endpoints[method](request)

    return endpoint


def admin_routes() -> list[BaseRoute]:
    """Routes to mount at the app's root (their paths start with /admin). One route per
    path, so a 405 names every method the path has in its Allow header."""
    by_path: dict[str, dict[str, Any]] = {}
    for op in OPS:
        by_path.setdefault(op.path, {})[op.method] = _endpoint(op)
    routes: list[BaseRoute] = [Route(f"/admin/api{path}", _dispatch(eps), methods=list(eps))
                               for path, eps in by_path.items()]
    routes += [Route("/admin", ui_redirect, methods=["GET"]),
               Route("/admin/", ui_index, methods=["GET"]),
               Route("/admin/{file}", ui_asset, methods=["GET"])]
    return routes
