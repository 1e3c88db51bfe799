"""The registry row records the current version's metadata when an adapter is published
or replaced, so a replica that never stored the version can describe it."""
from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from loraplex.adapters import AdapterStore, BaseShapes
from loraplex.platform.db.tables import Adapter
from loraplex.platform.tenancy.adapter_registry import adapter_info, add_adapter, list_adapters


def _metadata(info) -> tuple:
    return info.digest, info.rank, info.alpha, info.target_modules, info.size_bytes, info.features


def test_the_row_follows_the_current_version(tmp_path: Path, tiny_llama_dir, tiny_adapters, db):
    store = AdapterStore(tmp_path / "store", BaseShapes.from_model_dir(tiny_llama_dir))
    info = add_adapter(db, store, "meta", tiny_adapters["ad1"], public=True)
    r = store.get("meta")
    assert _metadata(info) == (r.digest, 4, r.alpha, r.target_modules, r.size_bytes, ())  # plain LoRA
    assert _metadata(adapter_info(db, "meta")) == _metadata(info)

    replaced = add_adapter(db, store, "meta", tiny_adapters["ad2"], replace=True)
    r2 = store.get("meta")
    assert (replaced.digest, replaced.rank) == (r2.digest, 8) and r2.digest != r.digest
    assert _metadata(replaced) == (r2.digest, 8, r2.alpha, r2.target_modules, r2.size_bytes, r2.features)
    assert [_metadata(a) for a in list_adapters(db)] == [_metadata(replaced)]


def test_a_row_without_metadata_reads_as_unknown(tmp_path: Path, tiny_llama_dir, tiny_adapters, db):
    store = AdapterStore(tmp_path / "store", BaseShapes.from_model_dir(tiny_llama_dir))
    add_adapter(db, store, "older", tiny_adapters["ad1"])
    with db.session() as s:  # as a row registered before the registry kept metadata
        row = s.scalars(select(Adapter).where(Adapter.name == "older")).one()
        row.rank = row.alpha = row.target_modules = row.size_bytes = row.features = None
    info = adapter_info(db, "older")
    assert _metadata(info)[1:] == (None, None, None, None, None)


def test_a_replica_refuses_an_adapter_over_its_rank_limit_by_the_registry_alone(
        tmp_path: Path, tiny_llama_dir, tiny_adapters, db):
    """The name resolves in the registry, with the rank it recorded: a replica whose
    max_lora_rank is below it refuses the request without fetching the version."""
    import pytest

    from loraplex.engine.config import LoRAConfig
    from loraplex.engine.errors import InvalidRequestError
    from loraplex.engine.lora import LoRAManager
    from loraplex.platform.assembly.shared_adapters import RegistryAdapterSource
    from loraplex.platform.tenancy.adapter_directory import AdapterDirectory

    store = AdapterStore(tmp_path / "store", BaseShapes.from_model_dir(tiny_llama_dir))
    info = add_adapter(db, store, "wide", tiny_adapters["ad2"])  # rank 8
    directory = AdapterDirectory(db)
    assert (directory.version("wide").digest, directory.version("wide").rank) == (info.digest, 8)
    # This replica's own store is empty and it has no shared one: only the registry answers.
    empty = AdapterStore(tmp_path / "empty", BaseShapes.from_model_dir(tiny_llama_dir))
    manager = LoRAManager(RegistryAdapterSource(directory, empty, shared=None), LoRAConfig(max_lora_rank=4))
    try:
        with pytest.raises(InvalidRequestError, match="rank 8"):
            manager.ref("wide")
    finally:
        manager.close()


def test_an_engine_over_the_registry_refuses_adding_adapters_itself(tmp_path: Path, tiny_llama_dir, db):
    """Names come from the registry replicas share, so an adapter is published through
    the platform; the engine's own add/remove say so instead of failing on a missing method."""
    import pytest

    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
    from loraplex.engine.engine import LLMEngine
    from loraplex.engine.errors import InvalidRequestError
    from loraplex.engine.lora import LoRAManager
    from loraplex.platform.assembly.shared_adapters import RegistryAdapterSource
    from loraplex.platform.tenancy.adapter_directory import AdapterDirectory

    local = AdapterStore(tmp_path / "store", BaseShapes.from_model_dir(tiny_llama_dir))
    cfg = EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
                       cache=CacheConfig(block_size=16, num_blocks=16), lora=LoRAConfig(max_loras=1))
    ae = AsyncEngine(LLMEngine(cfg, LoRAManager(RegistryAdapterSource(AdapterDirectory(db), local, None), cfg.lora)))
    try:
        for call in (lambda: ae.add_adapter("x", tmp_path), lambda: ae.remove_adapter("x")):
            with pytest.raises(InvalidRequestError, match="publish adapters through the platform"):
                call()
    finally:
        ae.shutdown()
