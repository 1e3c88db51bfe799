"""The admin API (JSON under /admin/api) and the admin UI's static files (under /admin).

Every operation is declared once in `OPS` (route, handler, OpenAPI description); the
document is served at /admin/api/openapi.json. Authentication and CSRF: admin_auth.py.
Errors: errors.py (the same `{"error": {...}}` body as the OpenAI routes).

Every change writes one audit row (audit.py) naming the admin credential that made it.
Changes to who may use what (keys revoked, tenants disabled, grants) take effect at once
in this process (its key cache is cleared) and within `auth_cache_ttl` on other replicas.

Adapter uploads stream to a private staging folder with a size limit, are validated in
full by the adapter store, and are published atomically: an adapter is visible (to the
engine and in listings) only once complete and valid; a bad upload changes nothing.
"""
from __future__ import annotations

import asyncio
import datetime as dt
import logging
import mimetypes
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from loraplex.adapters import AdapterError, AdapterNotFoundError, AdapterRecord, AdapterStore
from loraplex.adapters.store import validate_name

from . import audit
from .adapter_registry import (
    AdapterInfo,
    adapter_info,
    add_adapter,
    grant_adapter,
    list_adapters,
    open_store,
    remove_adapter,
    revoke_grant,
    set_adapter_access,
)
from .admin_auth import (
    COOKIE_PATH,
    CSRF_COOKIE,
    CSRF_HEADER,
    SESSION_COOKIE,
    SESSION_SECONDS,
    Admin,
    AdminAuth,
)
from .admin_schema import Op, check_query, openapi_document, parse_datetime, qparam, validate
from .db import Database
from .errors import (
    BadRequestError,
    NotFoundError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
    api_error,
    error_response,
)
from .gateway import Gateway
from .models import LANES, utcnow
from .settings import Settings
from .tenants import (
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

log = logging.getLogger(__name__)
API_VERSION = "1"
_MAX_FIELD_BYTES = 4096
_MAX_FIELDS = 32
_MAX_FILES = 2


def admin_ui_dir() -> Path:
    """The UI's static files: <repo>/admin_ui in a checkout, loraplex/admin_ui installed
    (both beside this package's folder)."""
    return Path(__file__).resolve().parent.parent / "admin_ui"


# -- state -------------------------------------------------------------------------------

@dataclass
class AdminState:
    settings: Settings
    db: Database
    gateway: Gateway
    auth: AdminAuth
    store: AdapterStore

    @classmethod
    def create(cls, settings: Settings, db: Database, gateway: Gateway) -> AdminState:
        """Built in the app's lifespan; a bad admin token setting stops the server there."""
        lora = getattr(gateway.engine.engine, "lora", None)
        # The engine's own store when it has one: an upload is then servable at once.
        store = lora.store if lora is not None else open_store(settings)
        _clean_stale_uploads(store.root / "uploads")
        auth = AdminAuth.from_settings(settings)
        if not auth.configured:
            log.warning("admin API: no admin token configured (set $LORAPLEX_ADMIN_TOKEN); /admin is locked")
        return cls(settings, db, gateway, auth, store)

    async def audit(self, admin: Admin, action: str, target: str, **details: Any) -> None:
        def write() -> None:
            with self.db.session() as s:
                audit.record(s, admin.actor, action, target, **details)

        await asyncio.to_thread(write)
        log.info("admin %s: %s %s", admin.actor, action, target)

    def access_changed(self) -> None:
        self.gateway.auth.invalidate()

    def adapters_changed(self) -> None:
        """A version was published or removed: this process resolves names afresh at once."""
        self.access_changed()
        forget = getattr(self.gateway, "forget_adapter_refs", None)
        if forget is not None:
            forget()


def _clean_stale_uploads(folder: Path, max_age: float = 3600.0) -> None:
    """Staging left by uploads a crashed process never finished (never visible anyway)."""
    import time

    if not folder.is_dir():
        return
    cutoff = time.time() - max_age
    for p in folder.iterdir():
        try:
            if p.name.startswith("upload-") and p.lstat().st_mtime < cutoff:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _state(request: Request) -> AdminState:
    return request.app.state.admin


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj, option=orjson.OPT_UTC_Z), status_code=status, media_type="application/json",
                    headers={"Cache-Control": "no-store", **(headers or {})})


async def _json_body(request: Request, schema: dict) -> dict:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise UnsupportedMediaTypeError("send the request body as JSON (Content-Type: application/json)")
    raw = await request.body()
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        raise BadRequestError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    validate(schema, body, "body")
    return body


def _endpoint(op: Op):
    async def endpoint(request: Request) -> Response:
        try:
            st = _state(request)
            admin = None
            if op.auth:
                admin = st.auth.authenticate(request.method, request.headers.get("authorization"),
                                             request.cookies.get(SESSION_COOKIE), request.headers.get(CSRF_HEADER))
            args: dict[str, Any] = {"query": check_query(op, request.query_params)}
            if op.body is not None:
                args["body"] = await _json_body(request, op.body)
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
        return _json(result, op.ok)

    endpoint.__name__ = op.operation_id
    return endpoint


# -- serializers ---------------------------------------------------------------------------

def _tenant_json(t: TenantInfo, quotas: dict | None = None) -> dict:
    return {"name": t.name, "default_lane": t.default_lane, "allowed_lanes": list(t.allowed_lanes),
            "enabled": t.enabled, "num_keys": t.num_keys, "quotas": quotas}


def _key_json(k, secret: str | None = None) -> dict:
    d = {"prefix": f"{KEY_PREFIX}{k.prefix}", "tenant": k.tenant, "name": k.name, "status": k.status(),
         "created_at": k.created_at, "expires_at": k.expires_at, "revoked_at": k.revoked_at,
         "last_used_at": k.last_used_at}
    if secret is not None:
        d["key"] = secret
    return d


def _residency(gw: Gateway) -> dict[str, str]:
    """digest -> "device" (a device slot) or "cpu" (the CPU tier); absent: on disk only."""
    lora = getattr(gw.engine.engine, "lora", None)
    if lora is None:
        return {}
    tiers = lora.tiers()
    where = {d: "cpu" for d in tiers.get("cpu", ())}
    where.update({d: "device" for d in tiers.get("device", ())})
    return where


def _record_json(r: AdapterRecord, where: dict[str, str]) -> dict:
    return {"digest": r.digest, "rank": r.rank, "alpha": r.alpha, "target_modules": list(r.target_modules),
            "size_bytes": r.size_bytes, "created_at": dt.datetime.fromtimestamp(r.created_at, dt.timezone.utc),
            "residency": where.get(r.digest, "disk")}


def _adapter_json(a: AdapterInfo, records: dict[str, AdapterRecord], where: dict[str, str],
                  versions: list[AdapterRecord] | None = None) -> dict:
    r = records.get(a.name)
    d: dict[str, Any] = {"name": a.name, "digest": a.digest, "public": a.public, "owner": a.owner,
                         "grants": list(a.grants), "created_at": a.created_at, "updated_at": a.updated_at,
                         "residency": where.get(a.digest, "disk" if r is not None else "missing"),
                         "rank": None, "alpha": None, "target_modules": [], "size_bytes": None}
    if r is not None:
        d.update(rank=r.rank, alpha=r.alpha, target_modules=list(r.target_modules), size_bytes=r.size_bytes)
    if versions is not None:
        d["versions"] = [_record_json(v, where) for v in versions]
    return d


async def _adapters_payload(st: AdminState, only: str | None = None) -> Any:
    def load():
        infos = [adapter_info(st.db, only)] if only else list_adapters(st.db)
        records = {r.name: r for r in st.store.list()}
        vers: dict[str, list[AdapterRecord]] = {}
        for a in infos:
            try:
                vers[a.name] = st.store.versions(a.name)
            except AdapterNotFoundError:
                vers[a.name] = []
        return infos, records, vers

    infos, records, vers = await asyncio.to_thread(load)
    where = _residency(st.gateway)
    if only:
        return _adapter_json(infos[0], records, where, vers[only])
    return [{**_adapter_json(a, records, where), "num_versions": len(vers[a.name])} for a in infos]


# -- quotas and usage (issue 5: quotas.py, usage.py) -----------------------------------------
# Imported lazily: the admin API works (without those sections) in a build without them.

def _quotas_module():
    try:
        from . import quotas
    except ImportError:
        return None
    return quotas if hasattr(quotas, "set_quota") and hasattr(quotas, "quota_status") else None


def _usage_module():
    try:
        from . import usage
    except ImportError:
        return None
    return usage if hasattr(usage, "usage_summary") and hasattr(usage, "export_usage") else None


class FeatureUnavailableError(NotFoundError):
    """A section of the admin API whose module this build lacks."""


def _get_quotas(st: AdminState, tenant: str) -> dict | None:
    """The tenant's limits and where it stands against them now (None: no quotas module)."""
    q = _quotas_module()
    if q is None:
        return None
    d = q.quota_status(st.db, tenant).as_dict()
    d.pop("tenant", None)
    d.pop("key_prefix", None)
    return d


def _set_quotas(st: AdminState, tenant: str, values: dict | None) -> None:
    q = _quotas_module()
    if q is None:
        raise FeatureUnavailableError("quotas are not available in this build")
    if values is None:  # null: clear every limit
        values = {f: None for f in QUOTA_FIELDS}
    q.set_quota(st.db, tenant, **values)


def _quotas_changed(st: AdminState, request: Request) -> None:
    usage_hooks = getattr(request.app.state, "usage", None)
    limits = getattr(usage_hooks, "limits", None)
    if limits is not None:
        limits.invalidate()


# -- handlers: session -----------------------------------------------------------------------

def _session_json(admin: Admin) -> dict:
    return {"actor": admin.actor, "csrf_token": admin.csrf,
            "expires_at": dt.datetime.fromtimestamp(admin.session_expires, dt.timezone.utc)
            if admin.session_expires else None}


async def get_session(request: Request, st: AdminState, admin: Admin, query: dict) -> Any:
    return _session_json(admin)


async def create_session(request: Request, st: AdminState, admin: None, query: dict, body: dict) -> Response:
    try:
        who = st.auth.check_token(body["token"])
    except Exception:
        await asyncio.sleep(0.2)  # a little friction for guessing; tokens are long anyway
        raise
    cookie, session = st.auth.new_session(who)
    await st.audit(session, "session.create", f"session:{session.session_id}")
    resp = _json(_session_json(session), 201)
    secure = request.url.scheme == "https"
    resp.set_cookie(SESSION_COOKIE, cookie, max_age=SESSION_SECONDS, path=COOKIE_PATH, httponly=True,
                    samesite="strict", secure=secure)
    resp.set_cookie(CSRF_COOKIE, session.csrf or "", max_age=SESSION_SECONDS, path=COOKIE_PATH, httponly=False,
                    samesite="strict", secure=secure)
    return resp


async def delete_session(request: Request, st: AdminState, admin: Admin, query: dict) -> Response:
    if admin.session_id:
        st.auth.sign_out(admin)
        await st.audit(admin, "session.delete", f"session:{admin.session_id}")
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
    if body.get("quotas") and _quotas_module() is None:
        raise FeatureUnavailableError("quotas are not available in this build")

    def make():
        t = create_tenant(st.db, body["name"], body.get("default_lane", "standard"), body.get("allowed_lanes"))
        if body.get("quotas"):
            _set_quotas(st, t.name, body["quotas"])
        return t, _get_quotas(st, t.name)

    t, quotas = await asyncio.to_thread(make)
    _quotas_changed(st, request)
    await st.audit(admin, "tenant.create", f"tenant:{t.name}", default_lane=t.default_lane,
                   allowed_lanes=list(t.allowed_lanes), **({"quotas": body["quotas"]} if body.get("quotas") else {}))
    return _tenant_json(t, quotas)


async def update_tenant_(request: Request, st: AdminState, admin: Admin, query: dict, body: dict,
                         name: str) -> Any:
    if "quotas" in body and _quotas_module() is None:
        raise FeatureUnavailableError("quotas are not available in this build")

    def change():
        before = tenant_info(st.db, name)
        t = update_tenant(st.db, name, lane=body.get("default_lane"), allowed=body.get("allowed_lanes"),
                          enabled=body.get("enabled"))
        if "quotas" in body:
            _set_quotas(st, name, body["quotas"])
        return before, t, _get_quotas(st, name)

    before, t, quotas = await asyncio.to_thread(change)
    st.access_changed()
    _quotas_changed(st, request)
    changes: dict[str, Any] = {}
    if (before.default_lane, before.allowed_lanes) != (t.default_lane, t.allowed_lanes):
        changes["lanes"] = {"from": [before.default_lane, list(before.allowed_lanes)],
                            "to": [t.default_lane, list(t.allowed_lanes)]}
    if before.enabled != t.enabled:
        changes["enabled"] = t.enabled
    if "quotas" in body:
        changes["quotas"] = body["quotas"]
    action = ("tenant.disable" if changes.get("enabled") is False else
              "tenant.enable" if changes.get("enabled") is True and len(changes) == 1 else "tenant.update")
    await st.audit(admin, action, f"tenant:{name}", **changes)
    return _tenant_json(t, quotas)


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


# -- handlers: adapters -------------------------------------------------------------------

async def list_adapters_(request: Request, st: AdminState, admin: Admin, query: dict) -> Any:
    return await _adapters_payload(st)


async def get_adapter_(request: Request, st: AdminState, admin: Admin, query: dict, name: str) -> Any:
    validate_name(name)
    return await _adapters_payload(st, name)


@dataclass
class _Upload:
    folder: Path  # staging: adapter_config.json + adapter_model.safetensors, or upload.zip
    fields: dict[str, list[str]]
    source: Path  # what the store validates: the folder or the zip
    total_bytes: int


def _sniff(head: bytes) -> str:
    """"zip", "json", "safetensors", "pickle" or "unknown" from a file's first bytes."""
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "zip"
    if head.lstrip()[:1] == b"{":
        return "json"
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < (100 << 20):
        return "safetensors"
    if head[:1] == b"\x80" or head.startswith(b"PK"):
        return "pickle"
    return "unknown"


async def _receive_upload(request: Request, st: AdminState, on_field) -> _Upload:
    """Stream a multipart body to a staging folder; fields go to `on_field(name, value)` as
    they arrive (so a bad adapter name stops the upload before its files are read)."""
    import python_multipart
    from python_multipart.multipart import parse_options_header

    limit = st.settings.admin_max_upload_bytes
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise UnsupportedMediaTypeError("upload the adapter as multipart/form-data: its two files "
                                        "(adapter_config.json, adapter_model.safetensors) or a .zip of the folder")
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit + 65536:
        raise PayloadTooLargeError(f"the upload is {int(length)} bytes, over the {limit} byte limit")
    uploads = st.store.root / "uploads"
    uploads.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="upload-", dir=uploads))
    fields: dict[str, list[str]] = {}
    files: list[tuple[str, Path, bytes]] = []  # (client filename, staged path, first bytes)
    state: dict[str, Any] = {"headers": [], "name": b"", "value": b"", "part": None, "total": 0, "nfields": 0}

    def on_part_begin():
        state["headers"], state["part"] = [], None

    def on_header_field(data, start, end):
        state["name"] += data[start:end]

    def on_header_value(data, start, end):
        state["value"] += data[start:end]

    def on_header_end():
        state["headers"].append((state["name"].lower(), state["value"]))
        state["name"], state["value"] = b"", b""

    def on_headers_finished():
        disp = dict(state["headers"]).get(b"content-disposition", b"")
        _, opts = parse_options_header(disp)
        if b"name" not in opts:
            raise BadRequestError("a multipart part has no name")
        fname = opts[b"name"].decode("utf-8", "replace")
        if b"filename" in opts:
            if len(files) >= _MAX_FILES:
                raise BadRequestError("upload at most two files: adapter_config.json and adapter_model.safetensors "
                                      "(or one .zip)")
            path = folder / f"part-{len(files)}"
            client = opts[b"filename"].decode("utf-8", "replace")
            state["part"] = {"kind": "file", "f": open(path, "xb"), "path": path, "client": client, "head": b""}
        else:
            state["nfields"] += 1
            if state["nfields"] > _MAX_FIELDS:
                raise BadRequestError("too many form fields")
            state["part"] = {"kind": "field", "name": fname, "data": bytearray()}

    def on_part_data(data, start, end):
        part = state["part"]
        chunk = data[start:end]
        state["total"] += len(chunk)
        if state["total"] > limit:
            raise PayloadTooLargeError(f"the upload is over the {limit} byte limit")
        if part["kind"] == "file":
            part["f"].write(chunk)
            if len(part["head"]) < 16:
                part["head"] += chunk[: 16 - len(part["head"])]
        else:
            part["data"] += chunk
            if len(part["data"]) > _MAX_FIELD_BYTES:
                raise BadRequestError(f"form field {part['name']!r} is too long")

    def on_part_end():
        part = state["part"]
        if part["kind"] == "file":
            part["f"].close()
            files.append((part["client"], part["path"], part["head"]))
        else:
            value = part["data"].decode("utf-8", "replace")
            fields.setdefault(part["name"], []).append(value)
            on_field(part["name"], value)
        state["part"] = None

    callbacks = dict(on_part_begin=on_part_begin, on_part_data=on_part_data, on_part_end=on_part_end,
                     on_header_field=on_header_field, on_header_value=on_header_value,
                     on_header_end=on_header_end, on_headers_finished=on_headers_finished)
    parser = python_multipart.MultipartParser(params[b"boundary"], callbacks)
    try:
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
        if state["part"] is not None:
            raise BadRequestError("the upload ended in the middle of a part (interrupted?)")
        source = _arrange(folder, files)
    except BaseException as exc:
        part = state.get("part")
        if part and part.get("kind") == "file":
            part["f"].close()
        shutil.rmtree(folder, ignore_errors=True)
        if isinstance(exc, ClientDisconnect):
            raise BadRequestError("the client went away before the upload completed") from None
        if isinstance(exc, python_multipart.exceptions.MultipartParseError):
            raise BadRequestError(f"the multipart body is malformed: {exc}") from None
        raise
    return _Upload(folder, fields, source, state["total"])


def _arrange(folder: Path, files: list[tuple[str, Path, bytes]]) -> Path:
    """Name the staged files as the adapter store expects; the client's file names are
    used as hints only, never as paths."""
    if not files:
        raise BadRequestError("no adapter files in the upload: send adapter_config.json and "
                              "adapter_model.safetensors, or a .zip of the adapter folder")
    kinds = [(_sniff(head), client, path) for client, path, head in files]
    for kind, client, _ in kinds:
        low = client.lower()
        if low.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl")) or (kind == "pickle" and not low.endswith(".zip")):
            raise BadRequestError(f"{_show(client)} is a pickled checkpoint; only safetensors is accepted "
                                  "(adapter_model.safetensors)")
    if len(kinds) == 1:
        kind, client, path = kinds[0]
        if kind == "zip":
            return path.rename(folder / "upload.zip")
        if kind in ("json", "safetensors"):
            missing = "adapter_model.safetensors" if kind == "json" else "adapter_config.json"
            raise BadRequestError(f"{missing} is missing: upload both files of the adapter, or a .zip of its folder")
        raise BadRequestError(f"{_show(client)} is neither a .zip nor an adapter file")
    if "zip" in [k for k, _, _ in kinds]:
        raise BadRequestError("upload either one .zip, or the two adapter files, not both")
    by_kind = {k: p for k, _, p in kinds}
    if set(by_kind) != {"json", "safetensors"}:
        names = ", ".join(_show(c) for _, c, _ in kinds)
        raise BadRequestError(f"expected adapter_config.json (JSON) and adapter_model.safetensors, got {names}")
    adapter = folder / "adapter"
    adapter.mkdir()
    by_kind["json"].rename(adapter / "adapter_config.json")
    by_kind["safetensors"].rename(adapter / "adapter_model.safetensors")
    return adapter


def _show(client_name: str) -> str:
    return repr(client_name.replace("\\", "/").rsplit("/", 1)[-1][:80])


def _bool_field(fields: dict[str, list[str]], name: str) -> bool | None:
    vals = fields.get(name)
    if not vals:
        return None
    v = vals[-1].strip().lower()
    if v in ("true", "1", "on", "yes"):
        return True
    if v in ("false", "0", "off", "no", ""):
        return False
    raise BadRequestError(f"{name}: {vals[-1]!r} is not true or false", name)


async def upload_adapter(request: Request, st: AdminState, admin: Admin, query: dict) -> Response:
    def on_field(name: str, value: str) -> None:
        if name == "name":
            _check_new_name(st, value)

    up = await _receive_upload(request, st, on_field)
    try:
        fields = up.fields
        unknown = set(fields) - {"name", "public", "owner", "grants"}
        if unknown:
            raise BadRequestError(f"{sorted(unknown)[0]}: unknown form field (known: name, public, owner, grants)")
        name = (fields.get("name") or [""])[-1]
        if not name:
            raise BadRequestError("name: is required (the adapter's name)", "name")
        _check_new_name(st, name)
        public = bool(_bool_field(fields, "public"))
        owner = (fields.get("owner") or [""])[-1].strip() or None
        grants = [g.strip() for v in fields.get("grants", []) for g in v.split(",") if g.strip()]
        info = await asyncio.to_thread(add_adapter, st.db, st.store, name, up.source, public=public, owner=owner,
                                       grants=grants, reserved=(st.settings.model_name,))
    finally:
        shutil.rmtree(up.folder, ignore_errors=True)
    st.adapters_changed()
    payload = await _adapters_payload(st, info.name)
    await st.audit(admin, "adapter.upload", f"adapter:{info.name}", digest=info.digest, public=info.public,
                   owner=info.owner, grants=list(info.grants), rank=payload["rank"], size_bytes=payload["size_bytes"],
                   upload_bytes=up.total_bytes)
    return _json(payload, 201)


def _check_new_name(st: AdminState, name: str) -> None:
    validate_name(name)
    if name == st.settings.model_name:
        raise BadRequestError(f"name: {name!r} is the base model's name; pick another adapter name", "name")


async def replace_adapter(request: Request, st: AdminState, admin: Admin, query: dict, name: str) -> Response:
    validate_name(name)
    before = await asyncio.to_thread(adapter_info, st.db, name)  # 404 before reading the body

    def on_field(field: str, value: str) -> None:
        raise BadRequestError(f"{field}: unknown form field (send only the adapter files)")

    up = await _receive_upload(request, st, on_field)
    try:
        info = await asyncio.to_thread(add_adapter, st.db, st.store, name, up.source, replace=True,
                                       reserved=(st.settings.model_name,))
    finally:
        shutil.rmtree(up.folder, ignore_errors=True)
    st.adapters_changed()
    payload = await _adapters_payload(st, name)
    await st.audit(admin, "adapter.replace", f"adapter:{name}", previous_digest=before.digest, digest=info.digest,
                   rank=payload["rank"], size_bytes=payload["size_bytes"], upload_bytes=up.total_bytes)
    return _json(payload, 200)


async def update_adapter_(request: Request, st: AdminState, admin: Admin, query: dict, body: dict,
                          name: str) -> Any:
    validate_name(name)
    owner = body["owner"] if "owner" in body else False
    before = await asyncio.to_thread(adapter_info, st.db, name)
    info = await asyncio.to_thread(set_adapter_access, st.db, name, public=body.get("public"), owner=owner)
    st.access_changed()
    changes = {}
    if before.public != info.public:
        changes["public"] = info.public
    if before.owner != info.owner:
        changes["owner"] = {"from": before.owner, "to": info.owner}
    action = ("adapter.make_public" if changes == {"public": True} else
              "adapter.make_private" if changes == {"public": False} else "adapter.update")
    await st.audit(admin, action, f"adapter:{name}", **changes)
    return await _adapters_payload(st, name)


async def grant_adapter_(request: Request, st: AdminState, admin: Admin, query: dict, name: str,
                         tenant: str) -> Any:
    validate_name(name)
    before = await asyncio.to_thread(adapter_info, st.db, name)
    await asyncio.to_thread(grant_adapter, st.db, name, tenant)
    st.access_changed()
    if tenant not in before.grants:
        await st.audit(admin, "adapter.grant", f"adapter:{name}", tenant=tenant)
    return await _adapters_payload(st, name)


async def revoke_grant_(request: Request, st: AdminState, admin: Admin, query: dict, name: str,
                        tenant: str) -> Any:
    validate_name(name)
    had = await asyncio.to_thread(revoke_grant, st.db, name, tenant)
    if not had:
        raise NotFoundError(f"tenant {tenant!r} has no grant of adapter {name!r}")
    st.access_changed()
    await st.audit(admin, "adapter.revoke_grant", f"adapter:{name}", tenant=tenant)
    return await _adapters_payload(st, name)


async def remove_adapter_(request: Request, st: AdminState, admin: Admin, query: dict, name: str) -> Any:
    validate_name(name)
    info = await asyncio.to_thread(remove_adapter, st.db, st.store, name)
    st.adapters_changed()
    await st.audit(admin, "adapter.remove", f"adapter:{name}", digest=info.digest)
    return {"name": info.name, "digest": info.digest, "removed": True}


# -- handlers: engine, audit, usage -----------------------------------------------------

async def engine_status(request: Request, st: AdminState, admin: Admin, query: dict) -> Any:
    gw = st.gateway
    stats = dict(gw.engine.stats())
    eng = gw.engine.engine
    lora = getattr(eng, "lora", None)
    where = _residency(gw)
    def digest_names() -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for cur in st.store.list():
            try:
                versions = st.store.versions(cur.name)
            except AdapterNotFoundError:  # removed meanwhile
                continue
            for i, r in enumerate(versions):
                out.setdefault(r.digest, []).append(r.name if i == 0 else f"{r.name} (older version)")
        return out

    names = await asyncio.to_thread(digest_names)
    resident = [{"digest": d, "tier": tier, "names": names.get(d, [])} for d, tier in where.items()]
    resident.sort(key=lambda x: (x["tier"] != "device", x["names"], x["digest"]))
    cfg = eng.config
    lanes = stats.get("lanes") or {}
    return {
        "model": gw.model_name, "running": gw.engine.is_running and not gw.draining,
        "device": str(getattr(getattr(eng, "runner", None), "device", "cpu")),
        "num_running": stats.get("num_running", 0), "num_waiting": stats.get("num_waiting", 0),
        "lanes": {lane: {"running": lanes.get(lane, {}).get("running", 0),
                         "waiting": lanes.get(lane, {}).get("waiting", 0)} for lane in LANES},
        "kv_cache_usage": float(stats.get("kv_cache_usage", 0.0)), "num_kv_blocks": stats.get("num_blocks"),
        "block_size": cfg.cache.block_size, "num_preemptions": stats.get("num_preemptions", 0),
        "prefix_cache_queries": stats.get("prefix_cache_queries", 0),
        "prefix_cache_hits": stats.get("prefix_cache_hits", 0),
        "max_loras": cfg.lora.max_loras if lora is not None else 0,
        "max_cpu_loras": cfg.lora.max_cpu_loras if lora is not None else 0,
        "resident_adapters": resident,
        "stats_time": dt.datetime.fromtimestamp(stats["time"], dt.timezone.utc) if stats.get("time") else None,
    }


async def list_audit(request: Request, st: AdminState, admin: Admin, query: dict) -> Any:
    def load():
        with st.db.session() as s:
            rows = audit.entries(s, limit=query.get("limit", 100), before_id=query.get("before"),
                                 action=query.get("action"), target=query.get("target"))
            return [{"id": r.id, "at": r.created_at, "actor": r.actor, "action": r.action, "target": r.target,
                     "details": r.details or {}} for r in rows]

    return await asyncio.to_thread(load)


def _usage_range(query: dict, granularity: str) -> tuple[dt.datetime, dt.datetime]:
    """[from, to): defaults to the last 24 hours (hourly) or 30 days (daily), aligned."""
    u = _usage_module()
    step = dt.timedelta(days=1) if granularity == "day" else dt.timedelta(hours=1)
    now = utcnow()
    floor = (now.replace(hour=0, minute=0, second=0, microsecond=0) if granularity == "day"
             else now.replace(minute=0, second=0, microsecond=0))
    end = u.parse_time(query["to"], "to") if query.get("to") else floor + step
    start = u.parse_time(query["from"], "from") if query.get("from") else end - step * (30 if step.days else 24)
    if end <= start:
        raise BadRequestError("to: must be after from", "to")
    if (end - start) / step > 5000:
        raise BadRequestError(f"the range holds over 5000 {granularity}s: pick a shorter range or a coarser "
                              "granularity", "from")
    return start, end


_SERIES_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens")


async def usage_series(request: Request, st: AdminState, admin: Admin, query: dict) -> Any:
    u = _usage_module()
    if u is None:
        raise FeatureUnavailableError("usage metering is not available in this build")
    granularity = query.get("granularity", "hour")
    group = query.get("group_by", "tenant")
    start, end = _usage_range(query, granularity)
    rows = await asyncio.to_thread(u.usage_summary, st.db, start, end, tenant=query.get("tenant"),
                                   adapter=query.get("adapter"), granularity=granularity,
                                   by_adapter=group == "adapter")
    series: dict[str, dict[dt.datetime, dict[str, int]]] = {}
    for r in rows:
        key = r.tenant if group == "tenant" else (r.adapter or BASE_MODEL_KEY)
        point = series.setdefault(key, {}).setdefault(r.period_start, dict.fromkeys(_SERIES_FIELDS, 0))
        for f in _SERIES_FIELDS:
            point[f] += getattr(r, f)
    totals = {k: {f: sum(p[f] for p in pts.values()) for f in _SERIES_FIELDS} for k, pts in series.items()}
    ordered = sorted(series, key=lambda k: -totals[k]["total_tokens"])
    return {"from": start, "to": end, "granularity": granularity, "group_by": group,
            "series": [{"key": k, "totals": totals[k],
                        "points": [{"t": t, **series[k][t]} for t in sorted(series[k])]} for k in ordered]}


_EXPORT_TYPES = {"csv": ("text/csv; charset=utf-8", "csv"), "jsonl": ("application/x-ndjson", "jsonl"),
                 "cloudevents": ("application/cloudevents-batch+json", "cloudevents.jsonl")}


async def usage_export(request: Request, st: AdminState, admin: Admin, query: dict) -> Response:
    from starlette.responses import StreamingResponse

    u = _usage_module()
    if u is None:
        raise FeatureUnavailableError("usage metering is not available in this build")
    fmt = query.get("format", "csv")
    granularity = query.get("granularity", "event")
    start, end = _usage_range(query, "day" if granularity == "day" else "hour")
    chunks = u.export_usage(st.db, start, end, fmt=fmt, granularity=granularity, tenant=query.get("tenant"))
    sentinel = object()
    first = await asyncio.to_thread(next, chunks, sentinel)  # argument errors raise here, before the 200

    def body():
        if first is not sentinel:
            yield first
        yield from chunks

    media, ext = _EXPORT_TYPES[fmt]
    stamp = f"{start:%Y%m%dT%H%M}-{end:%Y%m%dT%H%M}"
    return StreamingResponse(body(), media_type=media, headers={
        "Content-Disposition": f'attachment; filename="loraplex-usage-{granularity}-{stamp}.{ext}"',
        "Cache-Control": "no-store"})


async def get_openapi(request: Request, st: AdminState, admin: None, query: dict) -> Any:
    return request.app.state.admin_openapi


# -- the table ------------------------------------------------------------------------------

LANE = {"type": "string", "enum": list(LANES)}
NAME = {"type": "string", "minLength": 1, "maxLength": 64, "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        "description": "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"}
TS = {"type": ["string", "null"], "format": "date-time"}
BASE_MODEL_KEY = "(base model)"
ISO_TIME = {"type": "string", "maxLength": 40,
            "pattern": r"^\d{4}-\d{2}-\d{2}([Tt ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?([Zz]|[+-]\d{2}:?\d{2})?)?$",
            "description": "an ISO date (UTC midnight) or date-time"}
QUOTA_FIELDS = ("rpm", "tpm", "max_concurrency", "token_budget", "budget_period")
_LIMIT = {"type": ["integer", "null"], "minimum": 0}
QUOTAS_IN = {"type": ["object", "null"], "additionalProperties": False,
             "description": "Limits to set; a field left out keeps its value, null clears it (null: clear all)",
             "properties": {"rpm": {**_LIMIT, "description": "requests per minute"},
                            "tpm": {**_LIMIT, "description": "tokens per minute (prompt + max_tokens reserved)"},
                            "max_concurrency": {**_LIMIT, "description": "requests in flight at once"},
                            "token_budget": {**_LIMIT, "description": "tokens per budget period"},
                            "budget_period": {"type": ["string", "null"], "enum": ["day", "month", None]}}}
QUOTAS = {"type": ["object", "null"], "description": "The tenant's limits (null fields: no limit) and where it "
          "stands now; null when this build has no quotas",
          "properties": {**QUOTAS_IN["properties"],
                         "requests_this_minute": {"type": "integer"}, "tokens_this_minute": {"type": "integer"},
                         "in_flight": {"type": "integer"}, "budget_used": {"type": "integer"},
                         "budget_remaining": {"type": ["integer", "null"]},
                         "budget_period_start": TS, "budget_period_end": TS, "updated_at": TS}}
_POINT = {"type": "object", "required": ["t", "total_tokens"], "properties": {
    "t": {"type": "string", "format": "date-time"}, **{f: {"type": "integer"} for f in _SERIES_FIELDS}}}

COMPONENTS: dict[str, dict] = {
    "Session": {"type": "object", "required": ["actor", "csrf_token"], "properties": {
        "actor": {"type": "string"}, "csrf_token": {"type": ["string", "null"]}, "expires_at": TS}},
    "Tenant": {"type": "object", "required": ["name", "default_lane", "allowed_lanes", "enabled", "num_keys"],
               "properties": {"name": {"type": "string"}, "default_lane": LANE,
                              "allowed_lanes": {"type": "array", "items": LANE}, "enabled": {"type": "boolean"},
                              "num_keys": {"type": "integer", "description": "active keys"}, "quotas": QUOTAS}},
    "Key": {"type": "object", "required": ["prefix", "tenant", "status", "created_at"], "properties": {
        "prefix": {"type": "string", "description": "the key's visible part, lpx_<12 hex>"},
        "tenant": {"type": "string"}, "name": {"type": ["string", "null"]},
        "status": {"type": "string", "enum": ["active", "expired", "revoked"]},
        "created_at": {"type": "string", "format": "date-time"}, "expires_at": TS, "revoked_at": TS,
        "last_used_at": TS}},
    "AdapterVersion": {"type": "object", "required": ["digest", "rank", "size_bytes", "residency"], "properties": {
        "digest": {"type": "string"}, "rank": {"type": "integer"}, "alpha": {"type": "number"},
        "target_modules": {"type": "array", "items": {"type": "string"}}, "size_bytes": {"type": "integer"},
        "created_at": {"type": "string", "format": "date-time"},
        "residency": {"type": "string", "enum": ["device", "cpu", "disk"]}}},
    "Adapter": {"type": "object", "required": ["name", "digest", "public", "grants", "residency"], "properties": {
        "name": {"type": "string"}, "digest": {"type": "string", "description": "sha256:... of the current version"},
        "public": {"type": "boolean"}, "owner": {"type": ["string", "null"]},
        "grants": {"type": "array", "items": {"type": "string"}},
        "rank": {"type": ["integer", "null"]}, "alpha": {"type": ["number", "null"]},
        "target_modules": {"type": "array", "items": {"type": "string"}},
        "size_bytes": {"type": ["integer", "null"]}, "created_at": TS, "updated_at": TS,
        "residency": {"type": "string", "enum": ["device", "cpu", "disk", "missing"],
                      "description": "where the current version is now: a device slot, the CPU tier, or disk only"},
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
           "quotas": QUOTAS_IN}}),
    Op("GET", "/tenants/{name}", get_tenant_, "One tenant", "tenants", out="Tenant"),
    Op("PATCH", "/tenants/{name}", update_tenant_, "Change a tenant's lanes or quotas, or disable/enable it",
       "tenants", out="Tenant",
       body={"type": "object", "additionalProperties": False, "minProperties": 1, "properties": {
           "default_lane": LANE, "allowed_lanes": {"type": "array", "items": LANE, "minItems": 1, "uniqueItems": True},
           "enabled": {"type": "boolean"}, "quotas": QUOTAS_IN}}),
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
              qparam("before", {"type": "integer", "minimum": 1}, "entries with a smaller id (paging)"),
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


# -- the UI's files ----------------------------------------------------------------------------

UI_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-cache",
}


async def ui_index(request: Request) -> Response:
    path = admin_ui_dir() / "index.html"
    if not path.is_file():
        return error_response(api_error(NotFoundError(f"the admin UI files are missing ({path.parent})")))
    return FileResponse(path, media_type="text/html; charset=utf-8", headers=UI_HEADERS)


async def ui_asset(request: Request) -> Response:
    name = request.path_params["file"]
    files = {p.name: p for p in admin_ui_dir().iterdir() if p.is_file()} if admin_ui_dir().is_dir() else {}
    path = files.get(name)  # only files that are in the folder, by exact name: no paths
    if path is None:
        return error_response(api_error(NotFoundError(f"no admin UI file {name!r}")))
    media = mimetypes.guess_type(name)[0] or "application/octet-stream"
    if media.startswith("text/") or media.endswith("javascript"):
        media += "; charset=utf-8"
    return FileResponse(path, media_type=media, headers=UI_HEADERS)


async def ui_redirect(request: Request) -> Response:
    return RedirectResponse("/admin/", status_code=308)


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
