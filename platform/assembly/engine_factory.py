"""The one place the engine is built from settings."""
from __future__ import annotations

import logging

from loraplex.adapters.sources import BlobAdapterSource
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import LLMEngine
from loraplex.engine.lora import LoRAManager

from loraplex.platform.settings import Settings

log = logging.getLogger(__name__)


def build_lora_manager(settings: Settings) -> LoRAManager:
    """A LoRAManager over the adapters this process serves, chosen once here.

    Alone (the embedded default: SQLite, no shared store) the engine resolves names in
    the disk store the registry writes to (<data_dir>/adapters). As one of several
    replicas sharing an adapter store (`shared_blob_store`: the PostgreSQL database, or
    `adapter_store` / $LORAPLEX_ADAPTER_STORE), it resolves names in the registry, the
    version every replica serves, and fetches a version it lacks from the shared store
    by digest. Either way the database alone decides who may use which name.
    """
    from loraplex.platform.db.database import Database
    from loraplex.platform.assembly.shared_adapters import RegistryAdapterSource
    from loraplex.platform.tenancy.adapter_directory import AdapterDirectory
    from loraplex.platform.tenancy.adapter_registry import open_store, shared_blob_store

    store = open_store(settings)
    db = Database(settings.db_url)
    blobs = shared_blob_store(settings, db)
    if blobs is None:
        db.dispose()
        return LoRAManager(store, settings.engine.lora)
    log.info("adapters: names resolve in the registry; versions not on this replica's disk come from the "
             "shared adapter store")
    shared = BlobAdapterSource(blobs, store.base, settings.engine.lora.max_lora_rank)
    return LoRAManager(RegistryAdapterSource(AdapterDirectory(db), store, shared), settings.engine.lora)


def build_engine(settings: Settings) -> AsyncEngine:
    def build() -> LLMEngine:
        engine = LLMEngine(settings.engine, lora_manager=build_lora_manager(settings))
        engine.report_prefill = True  # metering bills the prompt tokens of a request aborted mid-prefill
        log.info("engine warmed up for every batch width in %.1f s", engine.warm_up())
        return engine

    # Built on the engine thread: the one thread that runs the model (async_engine.py).
    return AsyncEngine(build)
