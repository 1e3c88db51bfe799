"""A serving process collects the shared store's unreferenced adapter blobs by itself,
every `adapter_gc_interval_seconds` (a folder store on SQLite, the database on PostgreSQL)."""
from __future__ import annotations

import dataclasses
import time

import pytest

from loraplex.adapters import AdapterStore, BaseShapes
from loraplex.adapters.blobs import BlobStoreConfig, open_blob_store
from loraplex.platform.app import create_app
from loraplex.platform.db.database import Database, migrate
from loraplex.platform.tenancy.adapter_registry import add_adapter, remove_adapter
from tests.e2e.conftest import LiveServer
from tests.platform.fixtures import BACKENDS, fresh_db_url


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_removed_version_is_collected_without_anyone_asking(backend, tmp_path, base_settings, tiny_engine,
                                                               tiny_llama_dir, tiny_adapters, pg_schema_url):
    url = fresh_db_url(backend, tmp_path, pg_schema_url)
    migrate(url)
    shared = str(tmp_path / "shared") if backend == "sqlite" else None
    db = Database(url)
    blobs = open_blob_store(BlobStoreConfig(shared or url, cache_dir=tmp_path / "cache"),
                            engine=None if shared else db.engine)
    local = AdapterStore(tmp_path / "publisher", BaseShapes.from_model_dir(tiny_llama_dir))
    kept = add_adapter(db, local, "kept", tiny_adapters["ad1"], public=True, blobs=blobs).digest
    gone = add_adapter(db, local, "gone", tiny_adapters["ad2"], public=True, blobs=blobs).digest
    remove_adapter(db, local, "gone")  # as another replica or the CLI would: no pass runs here
    settings = dataclasses.replace(base_settings, database_url=url, adapter_store=shared, data_dir=tmp_path / "gw",
                                   adapter_gc_interval_seconds=0.2, adapter_gc_grace_seconds=0.0)
    try:
        with LiveServer(create_app(settings, tiny_engine)):
            deadline = time.monotonic() + 60
            while blobs.exists(gone) and time.monotonic() < deadline:
                time.sleep(0.1)
        assert not blobs.exists(gone) and blobs.exists(kept) and blobs.marks() == {}
    finally:
        db.dispose()
