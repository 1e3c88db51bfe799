"""A `serve` replica resolving adapter names in a shared PostgreSQL registry whose
adapters table is locked: the lookup waits off the event loop, so /health answers
meanwhile, and the request gets a 503 with Retry-After (no hang, no other 5xx); once the
lock is gone the adapter is served again."""
from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from loraplex.adapters import AdapterStore, BaseShapes
from loraplex.platform.app import create_app
from loraplex.platform.db.database import Database, migrate
from loraplex.platform.assembly.engine_factory import build_engine
from loraplex.platform.tenancy.adapter_registry import add_adapter, shared_blob_store
from loraplex.platform.tenancy.tenants import create_key, create_tenant
from tests.e2e.conftest import LiveServer

WAIT_S = 120  # a bound on every wait below: a hang fails instead of blocking


def _until(fn, what: str):
    deadline = time.monotonic() + WAIT_S
    while not (got := fn()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)
    return got


def test_a_locked_adapters_table_is_a_503_and_health_still_answers(tmp_path, base_settings, tiny_llama_dir,
                                                                   pg_schema_url):
    from loraplex.adapters.synth import make_random_peft_adapter

    url = pg_schema_url()
    migrate(url)
    db = Database(url)
    create_tenant(db, "tenant")
    key = create_key(db, "tenant")
    # Keys stay cached for the whole test: only the adapter lookup meets the lock.
    settings = dataclasses.replace(base_settings, database_url=url, data_dir=tmp_path / "replica",
                                   auth=dataclasses.replace(base_settings.auth, cache_ttl=600.0))
    path = make_random_peft_adapter(tiny_llama_dir, tmp_path / "ad", rank=4, seed=77)
    store = AdapterStore(tmp_path / "publisher", BaseShapes.from_model_dir(Path(tiny_llama_dir)))
    add_adapter(db, store, "locked-ad", path, public=True, blobs=shared_blob_store(settings, db))
    engine = build_engine(settings)
    locker = Database(url)
    try:
        app = create_app(settings, engine)
        with LiveServer(app) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=WAIT_S)

            def complete():
                return client.completions.create(model="locked-ad", prompt="hi", max_tokens=2, temperature=0)

            complete()  # key and adapter known; now forget the name so the next request asks the registry
            app.state.gateway.forget_adapter_refs()
            with locker.engine.connect() as lock, locker.engine.connect() as watch:
                lock.exec_driver_sql("LOCK TABLE adapters IN ACCESS EXCLUSIVE MODE")
                outcome: dict = {}

                def run() -> None:
                    try:
                        outcome["ok"] = complete()
                    except openai.APIStatusError as exc:
                        outcome["error"] = exc

                t = threading.Thread(target=run)
                t.start()
                _until(lambda: watch.exec_driver_sql(
                    "SELECT count(*) FROM pg_locks WHERE relation = 'adapters'::regclass AND NOT granted").scalar(),
                    "the lookup to wait on the lock")
                watch.rollback()
                health = httpx.get(f"{server.url}/health", timeout=WAIT_S)  # while the lookup waits
                t.join(WAIT_S)
                assert not t.is_alive()
                lock.rollback()  # the lock goes
            assert health.status_code == 200
            err = outcome.get("error")
            assert err is not None and err.status_code == 503, outcome
            assert err.response.headers.get("retry-after")
            assert err.body["code"] in ("database_unavailable", "adapter_registry_unavailable"), err.body
            assert complete().choices[0].text is not None  # served again
    finally:
        engine.shutdown()
        locker.dispose()
        db.dispose()
