"""Two gateways over one database and one shared adapter store, each with its own data
folder (as replicas of a fleet are): an adapter uploaded or replaced through one is
listed by the other as in the shared store, never as missing, with the current
version's rank, alpha, targets and size (from the registry), and never with the
metadata of a version it no longer serves. SQLite (a shared folder store) and PostgreSQL
(the database is the store)."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import httpx
import pytest

from loraplex.adapters import AdapterStore, BaseShapes
from loraplex.platform.app import create_app
from loraplex.platform.db.database import Database, migrate
from loraplex.platform.tenancy.adapter_registry import add_adapter
from loraplex.platform.settings import AdminConfig
from tests.e2e.admin_fixtures import (  # noqa: F401 - fixtures
    ADMIN_TOKEN,
    UPLOAD_LIMIT,
    AdminClient,
    adapter_files,
)
from tests.e2e.conftest import LiveServer
from tests.platform.fixtures import BACKENDS, fresh_db_url


@pytest.fixture(scope="module", params=BACKENDS)
def gateways(request, tmp_path_factory, base_settings, tiny_engine, pg_schema_url
             ) -> Iterator[tuple[AdminClient, AdminClient, Database, str]]:
    url = fresh_db_url(request.param, tmp_path_factory.mktemp("db"), pg_schema_url)
    migrate(url)
    # PostgreSQL: the adapter_blobs table is the shared store; SQLite: a folder both reach.
    shared = None if request.param == "postgresql" else str(tmp_path_factory.mktemp("shared-store"))
    apps = [create_app(dataclasses.replace(base_settings, database_url=url, adapter_store=shared,
                                           data_dir=tmp_path_factory.mktemp(f"gateway-{i}"), 
                                           admin=AdminConfig(token=ADMIN_TOKEN, max_upload_bytes=UPLOAD_LIMIT)),
                       tiny_engine)
            for i in range(2)]
    db = Database(url)
    with LiveServer(apps[0]) as one, LiveServer(apps[1]) as other:
        doc = httpx.get(f"{one.url}/admin/api/openapi.json").json()
        clients = AdminClient(one.url, doc), AdminClient(other.url, doc)  # answers checked against the schema
        yield *clients, db, shared or url
        for c in clients:
            c.close()
    db.dispose()


@pytest.fixture(scope="module")
def upload_adapters(tmp_path_factory, tiny_llama_dir) -> dict:
    """Adapters of this module's own (digests no other test's engine has loaded: the engine
    is shared, and an adapter it holds is listed by where it is there, not 'store')."""
    from loraplex.adapters.synth import make_random_peft_adapter

    root = tmp_path_factory.mktemp("shared_store_adapters")
    return {"r4": make_random_peft_adapter(tiny_llama_dir, root / "r4", rank=4, seed=4711, init_scale=0.3,
                                           target_modules=["q_proj", "v_proj"]),
            "r8": make_random_peft_adapter(tiny_llama_dir, root / "r8", rank=8, seed=4712, init_scale=0.3),
            "unpublished": make_random_peft_adapter(tiny_llama_dir, root / "u", rank=4, seed=4713, init_scale=0.3)}


def _listed(api: AdminClient) -> dict[str, dict]:
    r = api.get("/adapters")
    assert r.status_code == 200, r.text
    return {a["name"]: a for a in r.json()}


def _metadata(a: dict) -> dict:
    return {k: a[k] for k in ("digest", "rank", "alpha", "target_modules", "size_bytes", "features")}


def test_uploads_elsewhere_are_in_the_store(gateways, upload_adapters, tiny_llama_dir, tmp_path):
    """An adapter uploaded through the other gateway is in the shared store, not missing."""
    one, other, db, _ = gateways
    r = other.post("/adapters", data={"name": "via-other", "public": "true"},
                   files=adapter_files(upload_adapters["r4"]))
    assert r.status_code == 201, r.text
    seen = _listed(one)["via-other"]
    assert (seen["digest"], seen["residency"]) == (r.json()["digest"], "store")
    assert one.get("/adapters/via-other").json()["residency"] == "store"
    uploader = _listed(other)["via-other"]
    assert uploader["residency"] == "disk"  # the uploader keeps its own copy
    # The other gateway never had the files on its disk, yet describes the version alike.
    assert uploader["rank"] == 4 and sorted(uploader["target_modules"]) == ["q_proj", "v_proj"]
    assert uploader["size_bytes"] > 0 and uploader["alpha"] is not None and seen["features"] == []  # plain LoRA
    assert _metadata(seen) == _metadata(uploader) == _metadata(r.json())
    assert _metadata(one.get("/adapters/via-other").json()) == _metadata(uploader)

    # A registry row naming a version no store holds is still missing.
    unpublished = AdapterStore(tmp_path / "unpublished", BaseShapes.from_model_dir(tiny_llama_dir))
    add_adapter(db, unpublished, "nowhere", upload_adapters["unpublished"])  # no blob store: never published
    assert _listed(one)["nowhere"]["residency"] == "missing"


def test_a_version_replaced_through_another_gateway_is_not_shown_stale(gateways, upload_adapters):
    one, other, _, _ = gateways
    r = one.post("/adapters", data={"name": "replaced", "public": "true"}, files=adapter_files(upload_adapters["r4"]))
    assert r.status_code == 201 and r.json()["rank"] == 4, r.text
    r = other.post("/adapters/replaced/versions", files=adapter_files(upload_adapters["r8"]))
    assert r.status_code == 200 and r.json()["rank"] == 8, r.text
    seen = _listed(one)["replaced"]
    # Not the rank-4 version this gateway still keeps on its disk: the current one, elsewhere.
    assert (seen["digest"], seen["residency"], seen["rank"]) == (r.json()["digest"], "store", 8)
    replacer = _listed(other)["replaced"]
    assert replacer["residency"] == "disk"
    assert sorted(replacer["target_modules"]) != ["q_proj", "v_proj"]  # r8 targets more than r4 did
    assert _metadata(seen) == _metadata(replacer) == _metadata(r.json())
    assert _metadata(one.get("/adapters/replaced").json()) == _metadata(replacer)


def test_a_removed_version_is_marked_for_collection_in_the_shared_store(gateways, tiny_llama_dir, tmp_path):
    """Removing an adapter through the admin API runs a collection pass: the version's
    blob is marked (deleted by a pass after the grace), the current ones untouched."""
    from loraplex.adapters.blobs import BlobStoreConfig, open_blob_store
    from loraplex.adapters.synth import make_random_peft_adapter

    one, other, db, url = gateways
    folder = make_random_peft_adapter(tiny_llama_dir, tmp_path / "a", rank=4, seed=4714, init_scale=0.3)
    r = one.post("/adapters", data={"name": "short-lived", "public": "true"}, files=adapter_files(folder))
    assert r.status_code == 201, r.text
    digest = r.json()["digest"]
    apps_store = open_blob_store(BlobStoreConfig(url, cache_dir=tmp_path / "cache"),
                                 engine=db.engine if url == db.url else None)
    assert digest in apps_store.digests() and digest not in apps_store.marks()
    assert other.delete("/adapters/short-lived").status_code == 200
    assert digest in apps_store.marks() and digest in apps_store.digests()
    current = {a["digest"] for a in _listed(one).values()}
    assert not current & set(apps_store.marks())
