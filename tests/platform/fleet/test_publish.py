"""Publishing an adapter writes its blob to the shared store with the registry row, so a
worker that reads only the store fetches by digest what the registry names."""
from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from loraplex.adapters.blobs import BlobStoreConfig, load_blob, open_blob_store
from loraplex.adapters.shapes import BaseShapes
from loraplex.platform.db.tables import Adapter
from loraplex.platform.errors import ConflictError
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy.adapter_registry import add_adapter, open_store, shared_blob_store
from loraplex.engine.config import EngineConfig, ModelConfig


def _settings(db, tmp_path: Path, model_dir: Path, **kw) -> Settings:
    return Settings(engine=EngineConfig(model=ModelConfig(model=str(model_dir))), database_url=db.url,
                    data_dir=tmp_path / "gw", **kw)


def test_the_embedded_default_shares_nothing(tmp_path, tiny_llama_dir, db):
    settings = _settings(db, tmp_path, tiny_llama_dir)
    store = shared_blob_store(settings, db)
    assert (store is None) == (db.engine.dialect.name == "sqlite")


def test_a_published_version_is_fetchable_by_digest_from_the_shared_store(tmp_path, tiny_llama_dir, tiny_adapters,
                                                                         db):
    settings = _settings(db, tmp_path, tiny_llama_dir, adapter_store=db.url)
    blobs = shared_blob_store(settings, db)
    info = add_adapter(db, open_store(settings), "pub", tiny_adapters["ad1"], public=True, blobs=blobs)
    with db.session() as s:
        assert s.scalars(select(Adapter.digest).where(Adapter.name == "pub")).one() == info.digest

    # A worker: its own engine on the database, its own cache folder, no registry.
    worker = open_blob_store(BlobStoreConfig(db.url, cache_dir=tmp_path / "worker-cache"))
    adapter = load_blob(worker, info.digest, BaseShapes.from_model_dir(tiny_llama_dir))
    assert adapter.digest == info.digest and adapter.rank == 4

    replaced = add_adapter(db, open_store(settings), "pub", tiny_adapters["ad2"], replace=True, blobs=blobs)
    assert replaced.digest != info.digest
    assert worker.exists(replaced.digest) and worker.exists(info.digest)  # the old version keeps serving


def test_a_refused_publication_leaves_no_blob(tmp_path, tiny_llama_dir, tiny_adapters, db):
    settings = _settings(db, tmp_path, tiny_llama_dir, adapter_store=db.url)
    blobs = shared_blob_store(settings, db)
    add_adapter(db, open_store(settings), "taken", tiny_adapters["ad1"], blobs=blobs)
    with pytest.raises(ConflictError):
        add_adapter(db, open_store(settings), "taken", tiny_adapters["ad3"], blobs=blobs)
    from loraplex.adapters.peft import load_peft_adapter

    digest = load_peft_adapter(tiny_adapters["ad3"], BaseShapes.from_model_dir(tiny_llama_dir)).digest
    assert not blobs.exists(digest)
