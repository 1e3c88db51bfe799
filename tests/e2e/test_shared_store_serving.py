"""Two `serve` replicas over one database and one shared adapter store, each with its own
engine (built as `serve` builds it) and its own data folder: an adapter uploaded through
one replica is served by the other, at the version the registry names, and a version
replaced through either is the one both serve from then on. PostgreSQL (the database is
the store) and SQLite with a shared folder store."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import openai
import pytest

from loraplex.adapters import AdapterStore, BaseShapes
from loraplex.platform.app import create_app
from loraplex.platform.db.database import Database, migrate
from loraplex.platform.assembly.engine_factory import build_engine
from loraplex.platform.settings import AdminConfig, Settings
from loraplex.platform.tenancy.adapter_registry import add_adapter
from loraplex.platform.tenancy.tenants import create_key, create_tenant
from tests.e2e.admin_fixtures import ADMIN_TOKEN, UPLOAD_LIMIT, AdminClient, adapter_files
from tests.e2e.conftest import LiveServer
from tests.platform.fixtures import BACKENDS, fresh_db_url

PROMPT = "The quick brown fox"
MAX_TOKENS = 12
# A replica learns of a version published elsewhere from the database: its name cache
# (gateway.ADAPTER_REF_TTL) and auth cache (base_settings.auth.cache_ttl) expire well within this.
CONVERGE_S = 10.0

T = TypeVar("T")


@dataclass
class Replica:
    url: str
    settings: Settings
    admin: AdminClient

    def complete(self, key: str, model: str) -> str:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        return r.choices[0].text


@dataclass
class Replicas:
    a: Replica
    b: Replica
    key: str
    db: Database


@pytest.fixture(scope="module", params=BACKENDS)
def replicas(request, tmp_path_factory, base_settings, pg_schema_url) -> Iterator[Replicas]:
    url = fresh_db_url(request.param, tmp_path_factory.mktemp("db"), pg_schema_url)
    migrate(url)
    # PostgreSQL: the adapter_blobs table is the shared store; SQLite: a folder both reach.
    shared = None if request.param == "postgresql" else str(tmp_path_factory.mktemp("shared-store"))
    db = Database(url)
    create_tenant(db, "tenant")
    key = create_key(db, "tenant")
    settings = [dataclasses.replace(base_settings, database_url=url, adapter_store=shared,
                                    data_dir=tmp_path_factory.mktemp(f"replica-{i}"), 
                                    admin=AdminConfig(token=ADMIN_TOKEN, max_upload_bytes=UPLOAD_LIMIT))
                for i in range(2)]
    engines = [build_engine(s) for s in settings]  # each replica's own engine, as `serve` builds it
    try:
        with LiveServer(create_app(settings[0], engines[0])) as a, LiveServer(create_app(settings[1], engines[1])) as b:
            doc = httpx.get(f"{a.url}/admin/api/openapi.json").json()
            pair = Replicas(Replica(a.url, settings[0], AdminClient(a.url, doc)),
                            Replica(b.url, settings[1], AdminClient(b.url, doc)), key, db)
            yield pair
            pair.a.admin.close()
            pair.b.admin.close()
    finally:
        for e in engines:
            e.shutdown()
        db.dispose()


@pytest.fixture(scope="module")
def strong_adapters(tmp_path_factory, tiny_llama_dir) -> dict[str, Path]:
    """Versions of one adapter, each strong enough to change the tiny model's greedy output
    (content-addressed: one published in any test is in the store for every test after)."""
    from loraplex.adapters.synth import make_random_peft_adapter

    root = tmp_path_factory.mktemp("shared_serving_adapters")
    return {"v1": make_random_peft_adapter(tiny_llama_dir, root / "v1", rank=4, seed=5101, init_scale=0.3,
                                           target_modules=["q_proj", "v_proj"]),
            "v2": make_random_peft_adapter(tiny_llama_dir, root / "v2", rank=8, seed=5102, init_scale=0.3),
            "never-published": make_random_peft_adapter(tiny_llama_dir, root / "v3", rank=4, seed=5103,
                                                        init_scale=0.3)}


def eventually(fn: Callable[[], T], done: Callable[[T], bool] = lambda _: True) -> T:
    """`fn()` once it returns something `done` accepts, retrying (a 404 included: a name
    published elsewhere a moment ago) until CONVERGE_S; then its last answer or error."""
    deadline = time.monotonic() + CONVERGE_S
    while True:
        try:
            got = fn()
            if done(got) or time.monotonic() > deadline:
                return got
        except openai.NotFoundError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def test_an_upload_through_one_replica_is_served_by_the_other(replicas, strong_adapters):
    a, b, key = replicas.a, replicas.b, replicas.key
    r = a.admin.post("/adapters", data={"name": "shared-ad", "public": "true"},
                     files=adapter_files(strong_adapters["v1"]))
    assert r.status_code == 201, r.text
    from_a = a.complete(key, "shared-ad")
    from_b = eventually(lambda: b.complete(key, "shared-ad"))
    assert from_b == from_a
    assert from_a != a.complete(key, a.settings.model_name)  # the adapter does change the output
    # B holds no copy of its own: it served the version from the shared store.
    b_store = AdapterStore(b.settings.adapter_dir, BaseShapes.from_model_dir(Path(b.settings.engine.model.model)))
    assert b_store.list() == []


def test_a_version_replaced_through_the_other_replica_is_served_by_both(replicas, strong_adapters):
    a, b, key = replicas.a, replicas.b, replicas.key
    r = a.admin.post("/adapters", data={"name": "replaced-ad", "public": "true"},
                     files=adapter_files(strong_adapters["v1"]))
    assert r.status_code == 201, r.text
    old = a.complete(key, "replaced-ad")  # A now holds v1 on its disk and in its engine
    assert eventually(lambda: b.complete(key, "replaced-ad")) == old

    r = b.admin.post("/adapters/replaced-ad/versions", files=adapter_files(strong_adapters["v2"]))
    assert r.status_code == 200, r.text
    new = b.complete(key, "replaced-ad")
    assert new != old  # the two versions answer differently
    # A serves the registry's new version, not the one still on its own disk.
    assert eventually(lambda: a.complete(key, "replaced-ad"), lambda got: got == new) == new


def test_a_version_no_store_holds_is_a_clear_not_found(replicas, strong_adapters, tiny_llama_dir, tmp_path):
    """The registry names a version that never reached the shared store (registered
    without publishing it): both replicas refuse it with OpenAI's error body, as a fleet
    gateway does; A does not fall back to the older version its disk still holds."""
    a, b, key = replicas.a, replicas.b, replicas.key
    r = a.admin.post("/adapters", data={"name": "half-ad", "public": "true"}, files=adapter_files(strong_adapters["v1"]))
    assert r.status_code == 201, r.text
    assert eventually(lambda: b.complete(key, "half-ad")) == a.complete(key, "half-ad")
    elsewhere = AdapterStore(tmp_path / "unpublished", BaseShapes.from_model_dir(tiny_llama_dir))
    # No blob store given: the registry names the version, no store holds it.
    add_adapter(replicas.db, elsewhere, "half-ad", strong_adapters["never-published"], replace=True)
    for replica in (a, b):
        err = refused(lambda: replica.complete(key, "half-ad"))
        assert err.status_code == 404 and err.body["code"] == "model_not_found", err.body


def refused(fn: Callable[[], object]) -> openai.NotFoundError:
    """The 404 `fn` gets once the replica resolves the name afresh (within CONVERGE_S)."""
    deadline = time.monotonic() + CONVERGE_S
    while True:
        try:
            fn()
        except openai.NotFoundError as e:
            return e
        assert time.monotonic() < deadline, "still served"
        time.sleep(0.1)


def test_an_unreachable_store_is_a_clear_retryable_error(tmp_path, base_settings, tiny_llama_dir, strong_adapters,
                                                          monkeypatch):
    """A replica that must fetch a version from a shared store it cannot reach answers 503
    with Retry-After and OpenAI's error body, naming neither the store nor its address."""
    for name, value in (("AWS_ENDPOINT_URL", "http://127.0.0.1:9"),  # nothing listens there
                        ("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                        ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_EC2_METADATA_DISABLED", "true")):
        monkeypatch.setenv(name, value)
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(url)
    db = Database(url)
    create_tenant(db, "tenant")
    key = create_key(db, "tenant")
    # In the registry, on no disk of this replica's: it can only come from the store.
    elsewhere = AdapterStore(tmp_path / "elsewhere", BaseShapes.from_model_dir(tiny_llama_dir))
    add_adapter(db, elsewhere, "remote-ad", strong_adapters["v1"], public=True)
    settings = dataclasses.replace(base_settings, database_url=url, adapter_store="s3://loraplex-bucket/adapters",
                                   data_dir=tmp_path / "replica")
    engine = build_engine(settings)
    try:
        with LiveServer(create_app(settings, engine)) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)
            with pytest.raises(openai.InternalServerError) as e:
                client.completions.create(model="remote-ad", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    finally:
        engine.shutdown()
        db.dispose()
    err = e.value
    assert err.status_code == 503 and err.response.headers.get("retry-after"), err.body
    assert err.body["code"] == "adapter_store_unavailable", err.body
    assert "127.0.0.1" not in err.body["message"] and "loraplex-bucket" not in err.body["message"], err.body
