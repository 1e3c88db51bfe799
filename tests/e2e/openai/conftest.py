"""Live servers for the OpenAI-feature tests, on SQLite only (the database plays no part
in these features): the tiny Llama with adapters for wiring, the real SmolLM2 where the
output must mean something (tool calls)."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loraplex.platform.app import create_app
from loraplex.platform.db.database import Database, migrate
from loraplex.platform.assembly.engine_factory import build_engine
from loraplex.platform.tenancy.tenants import create_key, create_tenant
from tests.e2e.conftest import Live, LiveServer, RecordingHooks, _populate
from tests.platform.fixtures import fresh_db_url


def _serve(tmp_path_factory, settings, engine, adapters) -> Iterator[Live]:
    url = fresh_db_url("sqlite", tmp_path_factory.mktemp("db"), None)
    migrate(url)
    db = Database(url)
    settings = dataclasses.replace(settings, database_url=url)
    if adapters:
        keys = _populate(db, settings, adapters)
    else:
        create_tenant(db, "acme")
        keys = {"acme": create_key(db, "acme")}
    hooks = RecordingHooks()
    app = create_app(settings, engine, hooks=hooks)
    with LiveServer(app) as server:
        yield Live("sqlite", server.url, settings.model_name, keys, db, settings, app, engine, hooks)
    db.dispose()


@pytest.fixture(scope="session")
def oa(tmp_path_factory, base_settings, tiny_engine, tiny_adapters) -> Iterator[Live]:
    """The tiny Llama with the e2e tenants and adapters (acme may use `acme-private` and `pub`)."""
    yield from _serve(tmp_path_factory, base_settings, tiny_engine, tiny_adapters)


@pytest.fixture(scope="session")
def smol(tmp_path_factory, base_settings, smollm2_dir) -> Iterator[Live]:
    """SmolLM2-135M-Instruct itself (no adapters are used with it)."""
    config = EngineConfig(model=ModelConfig(model=str(smollm2_dir), dtype="float32", max_model_len=1024),
                          cache=CacheConfig(num_blocks=256, block_size=16),
                          scheduler=SchedulerConfig(max_num_seqs=8), num_threads=1)
    settings = dataclasses.replace(base_settings, engine=config,
                                   data_dir=tmp_path_factory.mktemp("smol_data"))
    engine = build_engine(settings)
    try:
        yield from _serve(tmp_path_factory, settings, engine, None)
    finally:
        engine.shutdown()
