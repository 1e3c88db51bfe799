"""Admin API handlers: adapters (upload, replace, access, grants, removal) and where
their versions reside (device, CPU tier, this process's disk, or the shared store)."""
from __future__ import annotations

import asyncio
import datetime as dt
import shutil
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from loraplex.adapters import AdapterNotFoundError, AdapterRecord
from loraplex.adapters.errors import BlobStoreError
from loraplex.adapters.store import validate_name

from loraplex.platform.tenancy.adapter_registry import (
    AdapterInfo,
    adapter_info,
    add_adapter,
    grant_adapter,
    list_adapters,
    remove_adapter,
    revoke_grant,
    set_adapter_access,
)
from loraplex.platform.admin.auth import Admin
from loraplex.platform.admin.state import AdminState, json_response, log
from loraplex.platform.admin.uploads import bool_field, receive_upload
from loraplex.platform.errors import BadRequestError, NotFoundError
from loraplex.platform.serving.gateway import Gateway
from loraplex.platform.tenancy.blob_gc import collect_blobs

async def _collect_blobs(st: AdminState) -> None:
    """A collection pass of the shared store after a version left the registry: marks it,
    and deletes what earlier passes marked more than the grace ago. A store that fails
    here is retried by the next pass; the change itself stands."""
    if st.blobs is None:
        return
    try:
        await asyncio.to_thread(collect_blobs, st.db, st.blobs, st.settings.adapter_gc_grace_seconds)
    except BlobStoreError as exc:
        log.warning("adapter blob collection failed (the next removal or `loraplex adapter gc` retries): %s", exc)


# -- serializers ---------------------------------------------------------------------------

def adapter_residency(gw: Gateway) -> dict[str, str]:
    """digest -> "device" (a device slot) or "cpu" (the CPU tier); absent: on disk only."""
    return gw.engine.adapter_residency().where()


def _record_json(r: AdapterRecord, where: dict[str, str]) -> dict:
    return {"digest": r.digest, "rank": r.rank, "alpha": r.alpha, "target_modules": list(r.target_modules),
            "size_bytes": r.size_bytes, "features": _features(r.features),
            "created_at": dt.datetime.fromtimestamp(r.created_at, dt.timezone.utc),
            "residency": where.get(r.digest, "disk")}


def _features(features: tuple[str, ...] | None) -> list[str] | None:
    return None if features is None else list(features)


def _adapter_json(a: AdapterInfo, kept: list[AdapterRecord], where: dict[str, str], stored: set[str],
                  with_versions: bool = False) -> dict:
    """`kept`: this process's versions of the name. The registry's digest is the truth: a
    version uploaded through another gateway is in the shared store, not in `kept`, and is
    described by the metadata the registry row recorded with that digest."""
    r = next((v for v in kept if v.digest == a.digest), None)
    residency = where.get(a.digest) or ("disk" if r is not None else "store" if a.digest in stored else "missing")
    d: dict[str, Any] = {"name": a.name, "digest": a.digest, "public": a.public, "owner": a.owner,
                         "grants": list(a.grants), "created_at": a.created_at, "updated_at": a.updated_at,
                         "residency": residency, "rank": a.rank, "alpha": a.alpha,
                         "target_modules": list(a.target_modules or ()), "size_bytes": a.size_bytes,
                         "features": _features(a.features)}
    if r is not None:
        d.update(rank=r.rank, alpha=r.alpha, target_modules=list(r.target_modules), size_bytes=r.size_bytes)
        if r.features is not None:  # a version this process stored before kinds were: the row's may know it
            d["features"] = list(r.features)
    if with_versions:
        d["versions"] = [_record_json(v, where) for v in kept]
    return d


def _in_shared_store(st: AdminState, digests: list[str]) -> set[str]:
    """Which of `digests` the shared adapter store holds (none without one)."""
    if st.blobs is None or not digests:
        return set()
    try:
        return {d for d in dict.fromkeys(digests) if st.blobs.exists(d)}
    except BlobStoreError as exc:  # the listing still answers; those versions show as missing
        log.warning("adapter store unreachable while listing adapters: %s", exc)
        return set()


async def _adapters_payload(st: AdminState, only: str | None = None) -> Any:
    def load():
        infos = [adapter_info(st.db, only)] if only else list_adapters(st.db)
        kept: dict[str, list[AdapterRecord]] = {}
        for a in infos:
            try:
                kept[a.name] = st.store.versions(a.name)
            except AdapterNotFoundError:
                kept[a.name] = []
        elsewhere = [a.digest for a in infos if all(v.digest != a.digest for v in kept[a.name])]
        return infos, kept, _in_shared_store(st, elsewhere)

    infos, kept, stored = await asyncio.to_thread(load)
    where = adapter_residency(st.gateway)
    if only:
        return _adapter_json(infos[0], kept[only], where, stored, with_versions=True)
    return [{**_adapter_json(a, kept[a.name], where, stored), "num_versions": len(kept[a.name])} for a in infos]


# -- handlers: adapters -------------------------------------------------------------------

async def list_adapters_(request: Request, st: AdminState, admin: Admin, query: dict) -> Any:
    return await _adapters_payload(st)


async def get_adapter_(request: Request, st: AdminState, admin: Admin, query: dict, name: str) -> Any:
    validate_name(name)
    return await _adapters_payload(st, name)


async def upload_adapter(request: Request, st: AdminState, admin: Admin, query: dict) -> Response:
    def on_field(name: str, value: str) -> None:
        if name == "name":
            _check_new_name(st, value)

    up = await receive_upload(request, st, on_field)
    try:
        fields = up.fields
        unknown = set(fields) - {"name", "public", "owner", "grants"}
        if unknown:
            raise BadRequestError(f"{sorted(unknown)[0]}: unknown form field (known: name, public, owner, grants)")
        name = (fields.get("name") or [""])[-1]
        if not name:
            raise BadRequestError("name: is required (the adapter's name)", "name")
        _check_new_name(st, name)
        public = bool(bool_field(fields, "public"))
        owner = (fields.get("owner") or [""])[-1].strip() or None
        grants = [g.strip() for v in fields.get("grants", []) for g in v.split(",") if g.strip()]
        info = await asyncio.to_thread(add_adapter, st.db, st.store, name, up.source, public=public, owner=owner,
                                       grants=grants, reserved=(st.settings.model_name,),
                                       blobs=st.blobs)
    finally:
        shutil.rmtree(up.folder, ignore_errors=True)
    st.adapters_changed()
    payload = await _adapters_payload(st, info.name)
    await st.audit(admin, "adapter.upload", f"adapter:{info.name}", digest=info.digest, public=info.public,
                   owner=info.owner, grants=list(info.grants), rank=payload["rank"], size_bytes=payload["size_bytes"],
                   features=payload["features"], upload_bytes=up.total_bytes)
    return json_response(payload, 201)


def _check_new_name(st: AdminState, name: str) -> None:
    validate_name(name)
    if name == st.settings.model_name:
        raise BadRequestError(f"name: {name!r} is the base model's name; pick another adapter name", "name")


async def replace_adapter(request: Request, st: AdminState, admin: Admin, query: dict, name: str) -> Response:
    validate_name(name)
    before = await asyncio.to_thread(adapter_info, st.db, name)  # 404 before reading the body

    def on_field(field: str, value: str) -> None:
        raise BadRequestError(f"{field}: unknown form field (send only the adapter files)")

    up = await receive_upload(request, st, on_field)
    try:
        info = await asyncio.to_thread(add_adapter, st.db, st.store, name, up.source, replace=True,
                                       reserved=(st.settings.model_name,), blobs=st.blobs)
    finally:
        shutil.rmtree(up.folder, ignore_errors=True)
    st.adapters_changed()
    await _collect_blobs(st)
    payload = await _adapters_payload(st, name)
    await st.audit(admin, "adapter.replace", f"adapter:{name}", previous_digest=before.digest, digest=info.digest,
                   rank=payload["rank"], size_bytes=payload["size_bytes"], features=payload["features"],
                   upload_bytes=up.total_bytes)
    return json_response(payload, 200)


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
    await _collect_blobs(st)
    await st.audit(admin, "adapter.remove", f"adapter:{name}", digest=info.digest)
    return {"name": info.name, "digest": info.digest, "removed": True}
