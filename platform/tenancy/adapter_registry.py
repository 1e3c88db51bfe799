"""Which adapters exist and who may use them.

The adapter *content* lives in the disk store (`loraplex.adapters.AdapterStore`, under
<data_dir>/adapters), which the engine also reads; the *access rules* live in the
database: an adapter is public, owned by one tenant, and/or granted to tenants.
"""
from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import or_, select

from loraplex.adapters import AdapterStore, BaseShapes
from loraplex.adapters.blobs import BlobStore, BlobStoreConfig, open_blob_store
from loraplex.adapters.errors import AdapterNotFoundError

from loraplex.platform.db.database import Database
from loraplex.platform.errors import BadRequestError, ConflictError, NotFoundError
from loraplex.platform.db.base import utcnow
from loraplex.platform.db.tables import Adapter, AdapterGrant
from loraplex.platform.tenancy.blob_gc import ensure_published
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy.tenants import get_tenant


ADAPTER_STORE_ENV = "LORAPLEX_ADAPTER_STORE"


def open_store(settings: Settings) -> AdapterStore:
    from loraplex.engine.config import DEFAULT_MODEL
    from loraplex.engine.checkpoint import resolve_model_dir

    model = settings.engine.model.model
    # A gateway's model folder holds config.json and the tokenizer, no weights: adapters
    # are validated against the shapes config.json gives.
    model_dir = resolve_model_dir(model) if model == DEFAULT_MODEL else Path(model).expanduser()
    return AdapterStore(settings.adapter_dir, base=BaseShapes.from_model_dir(model_dir),
                        max_rank=settings.engine.lora.max_lora_rank)


def shared_blob_store(settings: Settings, db: Database) -> BlobStore | None:
    """The adapter store every replica and worker fetches versions from by digest:
    `settings.adapter_store`, else $LORAPLEX_ADAPTER_STORE, else the platform's database
    when it is PostgreSQL (the blob rows then commit with the registry row); None for the
    embedded default (SQLite), which serves from its local folder."""
    url = settings.adapter_store or os.environ.get(ADAPTER_STORE_ENV) or None
    if url is None and db.engine.dialect.name != "postgresql":
        return None
    config = BlobStoreConfig(url or settings.db_url, cache_dir=settings.data_dir / "blob-cache",
                             cache_max_bytes=settings.adapter_cache_max_bytes)
    same_db = url is None or url == settings.db_url
    return open_blob_store(config, engine=db.engine if same_db else None)


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    digest: str
    owner: str | None
    public: bool
    grants: tuple[str, ...]
    created_at: dt.datetime | None = None
    updated_at: dt.datetime | None = None
    # The current version's (`digest`'s) shape as recorded when it was published; None
    # for a row registered before the registry kept it.
    rank: int | None = None
    alpha: float | None = None
    target_modules: tuple[str, ...] | None = None
    size_bytes: int | None = None
    # Its kind (`loraplex.adapters.features`): () plain LoRA, None unknown.
    features: tuple[str, ...] | None = None


def add_adapter(db: Database, store: AdapterStore, name: str, path: str | Path, *, public: bool = False,
                owner: str | None = None, grants: list[str] | tuple[str, ...] = (), replace: bool = False,
                reserved: tuple[str, ...] = (), blobs: BlobStore | None = None) -> AdapterInfo:
    """Validate and store the PEFT adapter at `path` as `name`, then record who may use it.

    With `blobs` (`shared_blob_store`), the version is published there too, before the
    registry row that names it commits (in that row's transaction for a database store),
    so no replica resolves the name to a digest its workers cannot fetch."""
    if name in reserved:
        raise BadRequestError(f"{name!r} is the base model's name; pick another adapter name")
    if not Path(path).exists():
        raise BadRequestError(f"adapter path {str(path)!r} does not exist")
    with db.session() as s:
        row = s.scalars(select(Adapter).where(Adapter.name == name)).first()
        if row is not None and not replace:
            raise ConflictError(f"an adapter named {name!r} already exists (use --replace for a new version)")
        owner_t = get_tenant(s, owner) if owner else None
        grant_ts = [get_tenant(s, g) for g in dict.fromkeys(grants)]
    # Replace in the store too when only the store has it (a half-finished earlier add).
    record = store.add(name, path, replace=True if row is not None or _in_store(store, name) else False)
    with db.session() as s:
        if blobs is not None:
            blobs.put(record.digest, store.blob_files(record.digest), connection=s.connection())
        row = s.scalars(select(Adapter).where(Adapter.name == name)).first()
        if row is None:
            row = Adapter(name=name, digest=record.digest, public=public)
            s.add(row)
        row.digest, row.updated_at = record.digest, utcnow()
        row.rank, row.alpha, row.size_bytes = record.rank, record.alpha, record.size_bytes
        row.target_modules = list(record.target_modules)
        row.features = None if record.features is None else list(record.features)
        row.public = row.public or public
        if owner_t is not None:
            row.owner_tenant_id = owner_t.id
        s.flush()
        have = {g.tenant_id for g in row.grants}
        for t in grant_ts:
            if t.id not in have:
                s.add(AdapterGrant(adapter_id=row.id, tenant_id=t.id))
        s.flush()
        s.refresh(row)
        info = _info(row)
    if blobs is not None:
        ensure_published(blobs, record.digest, store.blob_files(record.digest))
    return info


def _in_store(store: AdapterStore, name: str) -> bool:
    try:
        store.get(name)
        return True
    except AdapterNotFoundError:
        return False


def _info(row: Adapter) -> AdapterInfo:
    grants = tuple(sorted(g.tenant.name for g in row.grants))
    targets = tuple(row.target_modules) if row.target_modules is not None else None
    features = tuple(row.features) if row.features is not None else None
    return AdapterInfo(row.name, row.digest, row.owner.name if row.owner else None, row.public, grants,
                       row.created_at, row.updated_at, rank=row.rank, alpha=row.alpha, target_modules=targets,
                       size_bytes=row.size_bytes, features=features)


def list_adapters(db: Database) -> list[AdapterInfo]:
    with db.session() as s:
        return [_info(r) for r in s.scalars(select(Adapter).order_by(Adapter.name)).all()]


def grant_adapter(db: Database, name: str, tenant: str) -> None:
    with db.session() as s:
        row = s.scalars(select(Adapter).where(Adapter.name == name)).first()
        if row is None:
            raise AdapterNotFoundError(f"no adapter named {name!r}")
        t = get_tenant(s, tenant)
        if all(g.tenant_id != t.id for g in row.grants):
            s.add(AdapterGrant(adapter_id=row.id, tenant_id=t.id))


def adapters_for_tenant(s, tenant_id: int) -> list[str]:
    """Names of the adapters `tenant_id` may use: public, owned, or granted."""
    granted = select(AdapterGrant.adapter_id).where(AdapterGrant.tenant_id == tenant_id)
    q = select(Adapter.name).where(or_(Adapter.public.is_(True), Adapter.owner_tenant_id == tenant_id,
                                       Adapter.id.in_(granted)))
    return sorted(s.scalars(q).all())


def _row(s, name: str) -> Adapter:
    row = s.scalars(select(Adapter).where(Adapter.name == name)).first()
    if row is None:
        raise NotFoundError(f"no adapter named {name!r}")
    return row


def adapter_info(db: Database, name: str) -> AdapterInfo:
    with db.session() as s:
        return _info(_row(s, name))


def set_adapter_access(db: Database, name: str, *, public: bool | None = None,
                       owner: str | None | bool = False) -> AdapterInfo:
    """Make an adapter public or private, and/or set its owner (None: no owner; False: unchanged)."""
    with db.session() as s:
        row = _row(s, name)
        if public is not None:
            row.public = public
        if owner is not False:
            row.owner_tenant_id = get_tenant(s, owner).id if owner else None
        row.updated_at = utcnow()
        s.flush()
        s.refresh(row)
        return _info(row)


def revoke_grant(db: Database, name: str, tenant: str) -> bool:
    """Take `tenant`'s grant of adapter `name` away; False when it had none."""
    with db.session() as s:
        row = _row(s, name)
        t = get_tenant(s, tenant)
        grant = s.get(AdapterGrant, (row.id, t.id))
        if grant is None:
            return False
        s.delete(grant)
        return True


def remove_adapter(db: Database, store: AdapterStore, name: str) -> AdapterInfo:
    """Unregister `name`: no tenant may use it from then on, then its files leave the store
    (requests already running with it finish with the weights they loaded)."""
    with db.session() as s:
        row = _row(s, name)
        info = _info(row)
        s.delete(row)
    try:
        store.remove(name)
    except AdapterNotFoundError:
        pass
    return info
