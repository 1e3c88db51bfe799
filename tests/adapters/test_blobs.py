"""The shared adapter blob store, each implementation against the real thing: a folder,
PostgreSQL at 127.0.0.1:5432 (and SQLite), and S3 as served by moto's standalone server
running as its own process on a loopback port."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select, update

from loraplex.adapters import AdapterStore, BaseShapes, load_peft_adapter
from loraplex.adapters.blobs import (
    BlobStore,
    BlobStoreConfig,
    CachedBlobStore,
    LocalBlobStore,
    load_blob,
    open_blob_store,
)
from loraplex.adapters.blobs_s3 import S3BlobStore
from loraplex.adapters.blobs_sql import ADAPTER_BLOBS, SqlBlobStore
from loraplex.adapters.digest import digest_hex
from loraplex.adapters.errors import AdapterCorruptedError, AdapterNotFoundError, BlobStoreError
from tests.platform.fixtures import pg_schema_url  # noqa: F401 - fixture

BACKENDS = ("local", "sqlite", "postgresql", "s3")
BUCKET = "loraplex-test"
WEIGHTS = "adapter_model.safetensors"


# ---- two validated adapters to store ----------------------------------------------------------


@pytest.fixture(scope="module")
def validated(tmp_path_factory: pytest.TempPathFactory, base: BaseShapes, make_adapter: Callable[..., Path]
              ) -> AdapterStore:
    store = AdapterStore(tmp_path_factory.mktemp("validated"), base)
    store.add("v1", make_adapter(rank=4, alpha=8, target_modules=["q_proj", "v_proj"], seed=3))
    store.add("v2", make_adapter(rank=2, alpha=4, target_modules=["o_proj"], seed=4))
    return store


def blob(validated: AdapterStore, name: str) -> tuple[str, dict[str, Path]]:
    digest = validated.get(name).digest
    return digest, validated.blob_files(digest)


# ---- the S3-compatible server -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = open(tmp_path_factory.mktemp("moto") / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto's server did not start (exit code {proc.poll()})")
                time.sleep(0.1)
        with pytest.MonkeyPatch.context() as mp:
            for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                         "AWS_DEFAULT_REGION": "us-east-1"}.items():
                mp.setenv(k, v)
            endpoint = f"http://127.0.0.1:{port}"
            S3BlobStore(BUCKET, "", tmp_path_factory.mktemp("c"), endpoint_url=endpoint).client.create_bucket(
                Bucket=BUCKET)
            yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


# ---- one store per backend ------------------------------------------------------------------------


@pytest.fixture
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    backend = request.param
    if backend == "local":
        return str(tmp_path / "local")
    if backend == "s3":
        request.getfixturevalue("s3_endpoint")
        return f"s3://{BUCKET}/{tmp_path.name}/blobs"
    from loraplex.platform.db import migrate

    url = f"sqlite:///{tmp_path / 'db.sqlite'}" if backend == "sqlite" else request.getfixturevalue("pg_schema_url")()
    migrate(url)
    return url


@pytest.fixture
def open_store(
    store_url: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[[str], BlobStore]]:
    """open_store(cache name) -> a store on the same backend, as another replica would open it."""
    engines = []
    endpoint = request.getfixturevalue("s3_endpoint") if store_url.startswith("s3://") else None

    def make(cache: str = "cache") -> BlobStore:
        store = open_blob_store(BlobStoreConfig(store_url, tmp_path / cache, s3_endpoint_url=endpoint))
        if isinstance(store, SqlBlobStore):
            engines.append(store.engine)
        return store

    yield make
    for engine in engines:
        engine.dispose()


def parametrized(test: Callable[..., None]) -> Callable[..., None]:
    return pytest.mark.parametrize("store_url", BACKENDS, indirect=True)(test)


def corrupt(store: BlobStore, digest: str) -> None:
    """Flip one byte of the stored weights, in the store itself."""
    if isinstance(store, LocalBlobStore):
        path = store.path(digest) / WEIGHTS
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    elif isinstance(store, SqlBlobStore):
        t = ADAPTER_BLOBS
        where = (t.c.digest == digest) & (t.c.file_name == WEIGHTS) & (t.c.chunk_index == 0)
        with store.engine.begin() as conn:
            data = bytearray(conn.execute(select(t.c.data).where(where)).scalar_one())
            data[-1] ^= 0xFF
            conn.execute(update(t).where(where).values(data=bytes(data)))
    else:
        assert isinstance(store, S3BlobStore)
        key = store._key(digest, WEIGHTS)
        data = bytearray(store.client.get_object(Bucket=store.bucket, Key=key)["Body"].read())
        data[-1] ^= 0xFF
        store.client.put_object(Bucket=store.bucket, Key=key, Body=bytes(data))


def all_at_once(
    call: Callable[[BlobStore], object], stores: list[BlobStore]
) -> tuple[list[object], list[BaseException]]:
    """call(store) for every store, each in its own thread, released together."""
    start, results, errors = threading.Barrier(len(stores)), [], []

    def run(store: BlobStore) -> None:
        start.wait()
        try:
            results.append(call(store))
        except Exception as e:  # noqa: BLE001 - returned to the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


# ---- the contract, on every backend -------------------------------------------------------------


@parametrized
def test_put_get_round_trip(open_store: Callable[..., BlobStore], validated: AdapterStore, base: BaseShapes) -> None:
    store = open_store()
    digest, files = blob(validated, "v1")
    assert not store.exists(digest)
    with pytest.raises(AdapterNotFoundError):
        store.get(digest)
    store.put(digest, files)
    store.put(digest, files)  # idempotent
    other = open_store("replica-2")  # another replica, its own cache
    assert other.exists(digest)
    folder = other.get(digest)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == {n: p.read_bytes() for n, p in files.items()}
    assert load_peft_adapter(folder, base).digest == digest
    assert load_blob(other, digest, base).digest == digest  # a worker's first use, then its cache


@parametrized
def test_delete(open_store: Callable[..., BlobStore], validated: AdapterStore) -> None:
    store = open_store()
    digest, files = blob(validated, "v1")
    store.put(digest, files)
    store.delete(digest)
    store.delete(digest)  # absent: no error
    assert not store.exists(digest)
    with pytest.raises(AdapterNotFoundError):
        open_store("fresh").get(digest)


@parametrized
def test_corrupted_blob_fails_verification_and_is_not_cached(
    open_store: Callable[..., BlobStore], validated: AdapterStore, tmp_path: Path
) -> None:
    store = open_store()
    digest, files = blob(validated, "v1")
    store.put(digest, files)
    corrupt(store, digest)
    with pytest.raises(AdapterCorruptedError, match=f"stored adapter {digest} is corrupted"):
        store.get(digest)
    if isinstance(store, CachedBlobStore):
        assert list(store.cache_dir.iterdir()) == []  # neither the blob nor its staging remain


@parametrized
def test_concurrent_fetches_of_one_digest(
    open_store: Callable[..., BlobStore], validated: AdapterStore, base: BaseShapes
) -> None:
    digest, files = blob(validated, "v2")
    open_store("writer").put(digest, files)
    replicas = [open_store("shared-cache") for _ in range(6)]  # one cache folder, like one worker's
    results, errors = all_at_once(lambda store: store.get(digest), replicas)
    assert errors == [] and len(set(results)) == 1
    assert load_peft_adapter(results[0], base).digest == digest
    if isinstance(replicas[0], CachedBlobStore):
        assert [p.name for p in replicas[0].cache_dir.iterdir()] == [digest_hex(digest)]


@parametrized
def test_replace_leaves_the_version_in_use_alone(
    open_store: Callable[..., BlobStore], validated: AdapterStore
) -> None:
    writer, worker = open_store("writer"), open_store("worker")
    old, old_files = blob(validated, "v1")
    new, new_files = blob(validated, "v2")
    writer.put(old, old_files)
    in_use = worker.get(old)
    before = {p.name: p.read_bytes() for p in in_use.iterdir()}
    writer.put(new, new_files)
    writer.delete(old)  # the registry let go of the old version
    assert worker.get(new) != in_use
    if isinstance(worker, CachedBlobStore):  # the worker's copy outlives the store's
        assert {p.name: p.read_bytes() for p in in_use.iterdir()} == before


# ---- remote stores: the cache -------------------------------------------------------------------


@pytest.mark.parametrize("store_url", ["sqlite", "postgresql", "s3"], indirect=True)
def test_cache_is_reused_without_the_store(open_store: Callable[..., BlobStore], validated: AdapterStore) -> None:
    store = open_store()
    digest, files = blob(validated, "v1")
    store.put(digest, files)
    first = store.get(digest)
    stamp = (first / WEIGHTS).stat().st_mtime_ns
    open_store("elsewhere").delete(digest)  # gone from the store: only the cache can answer
    assert store.get(digest) == first and (first / WEIGHTS).stat().st_mtime_ns == stamp
    assert isinstance(store, CachedBlobStore)
    store.evict(digest)
    with pytest.raises(AdapterNotFoundError):
        store.get(digest)


# ---- the database store: one transaction with the registry ----------------------------------------


@pytest.mark.parametrize("store_url", ["sqlite", "postgresql"], indirect=True)
def test_put_joins_the_callers_transaction(open_store: Callable[..., BlobStore], validated: AdapterStore) -> None:
    store = open_store()
    assert isinstance(store, SqlBlobStore)
    digest, files = blob(validated, "v1")
    with pytest.raises(RuntimeError), store.engine.begin() as conn:
        store.put(digest, files, connection=conn)
        raise RuntimeError("the registry's publish failed")
    assert not store.exists(digest)
    with store.engine.begin() as conn:
        store.put(digest, files, connection=conn)
    assert store.exists(digest)


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
def test_concurrent_puts_of_one_digest(open_store: Callable[..., BlobStore], validated: AdapterStore) -> None:
    digest, files = blob(validated, "v1")
    replicas = [open_store(f"r{i}") for i in range(4)]
    _, errors = all_at_once(lambda store: store.put(digest, files), replicas)
    assert errors == []
    store = replicas[0]
    assert isinstance(store, SqlBlobStore)
    with store.engine.connect() as conn:
        rows = conn.execute(select(func.count()).select_from(ADAPTER_BLOBS)).scalar_one()
    assert rows == len(files)  # one chunk per file: nothing doubled
    store.get(digest)


@pytest.mark.parametrize("store_url", ["sqlite", "postgresql"], indirect=True)
def test_migration_creates_the_table_the_store_uses(store_url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy import MetaData

    from loraplex.adapters.blobs_sql import adapter_blobs_table

    metadata = MetaData(naming_convention={"pk": "pk_%(table_name)s"})
    adapter_blobs_table(metadata)
    engine = create_engine(store_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={
                "compare_type": True,
                "include_name": lambda name, kind, parents: kind != "table" or name == "adapter_blobs",
            })
            assert compare_metadata(ctx, metadata) == []
    finally:
        engine.dispose()


# ---- choosing a store -----------------------------------------------------------------------------


def test_store_chosen_from_the_url(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert isinstance(open_blob_store(BlobStoreConfig(str(tmp_path / "a"))), LocalBlobStore)
    assert isinstance(open_blob_store(BlobStoreConfig(f"file://{tmp_path / 'b'}")), LocalBlobStore)
    sql = open_blob_store(BlobStoreConfig(f"sqlite:///{tmp_path / 'x.sqlite'}", cache))
    assert isinstance(sql, SqlBlobStore)
    sql.engine.dispose()
    s3 = open_blob_store(BlobStoreConfig("s3://bucket/some/prefix", cache, s3_endpoint_url="http://127.0.0.1:9"))
    assert isinstance(s3, S3BlobStore) and (s3.bucket, s3.prefix) == ("bucket", "some/prefix")
    with pytest.raises(BlobStoreError, match="unsupported adapter store URL"):
        open_blob_store(BlobStoreConfig("ftp://host/x", cache))
    with pytest.raises(BlobStoreError, match="give it a local cache folder"):
        open_blob_store(BlobStoreConfig("s3://bucket/p"))
