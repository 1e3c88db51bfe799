"""The shared adapter blob store, each implementation against the real thing: a folder,
PostgreSQL at 127.0.0.1:5432 (and SQLite), and S3 as served by moto's standalone server
running as its own process on a loopback port."""
from __future__ import annotations

import gc
import logging
import os
import shutil
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
    """open_store(cache name, max_bytes) -> a store on the same backend, as another replica
    would open it, its cache bounded to max_bytes (None: unbounded)."""
    engines = []
    endpoint = request.getfixturevalue("s3_endpoint") if store_url.startswith("s3://") else None

    def make(cache: str = "cache", max_bytes: int | None = None) -> BlobStore:
        config = BlobStoreConfig(store_url, tmp_path / cache, s3_endpoint_url=endpoint, cache_max_bytes=max_bytes)
        store = open_blob_store(config)
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


# ---- remote stores: the cache's size bound --------------------------------------------------------

REMOTE = ("sqlite", "postgresql", "s3")


class Blobs:
    """Four adapter versions of one shape (so one size) published in a store, by letter."""

    def __init__(self, versions: list[tuple[str, dict[str, Path]]]) -> None:
        self.digest = dict(zip("abcd", (d for d, _ in versions)))
        self.files = dict(zip("abcd", (f for _, f in versions)))
        sizes = {sum(p.stat().st_size for p in files.values()) for files in self.files.values()}
        assert len(sizes) == 1, sizes
        self.size = sizes.pop()

    def publish(self, store: BlobStore) -> None:
        for letter, digest in self.digest.items():
            store.put(digest, self.files[letter])

    def cached(self, store: BlobStore) -> set[str]:
        """The letters of the blobs in the store's cache folder; nothing else may be there."""
        assert isinstance(store, CachedBlobStore)
        names = {p.name for p in store.cache_dir.iterdir()}
        by_hex = {digest_hex(d): letter for letter, d in self.digest.items()}
        assert names <= set(by_hex), f"not a cached blob: {names - set(by_hex)}"
        return {by_hex[n] for n in names}


@pytest.fixture(scope="module")
def same_size(tmp_path_factory: pytest.TempPathFactory, base: BaseShapes, make_adapter: Callable[..., Path]
              ) -> Blobs:
    store = AdapterStore(tmp_path_factory.mktemp("same-size"), base)
    versions = []
    for i, name in enumerate("abcd"):
        digest = store.add(name, make_adapter(rank=4, alpha=8, target_modules=["q_proj", "v_proj"], seed=20 + i)).digest
        versions.append((digest, store.blob_files(digest)))
    return Blobs(versions)


@pytest.mark.parametrize("store_url", REMOTE, indirect=True)
def test_a_bounded_cache_evicts_the_least_recently_used(
    open_store: Callable[..., BlobStore], same_size: Blobs, base: BaseShapes
) -> None:
    blobs = same_size
    blobs.publish(open_store("writer"))
    store = open_store("bounded", max_bytes=int(2.5 * blobs.size))
    store.get(blobs.digest["a"])
    store.get(blobs.digest["b"])
    assert blobs.cached(store) == {"a", "b"}
    store.get(blobs.digest["a"])  # a hit: b is now the least recently used
    store.get(blobs.digest["c"])
    assert blobs.cached(store) == {"a", "c"}
    assert load_blob(store, blobs.digest["d"], base).digest == blobs.digest["d"]
    assert blobs.cached(store) == {"c", "d"}
    assert isinstance(store, CachedBlobStore) and store.cache.total_bytes() == 2 * blobs.size
    assert store.get(blobs.digest["b"]).is_dir()  # an evicted version is fetched again on demand
    assert blobs.cached(store) == {"d", "b"}


@pytest.mark.parametrize("store_url", ["sqlite", "s3"], indirect=True)
def test_a_blob_being_read_survives_a_fetch_that_would_evict_it(
    open_store: Callable[..., BlobStore], same_size: Blobs
) -> None:
    blobs = same_size
    blobs.publish(open_store("writer"))
    store = open_store("bounded", max_bytes=int(2.5 * blobs.size))
    assert isinstance(store, CachedBlobStore)
    store.get(blobs.digest["a"])
    store.get(blobs.digest["b"])
    holding, release, read = threading.Event(), threading.Event(), {}

    def reader() -> None:
        with store.open(blobs.digest["a"]) as folder:
            holding.set()
            release.wait(timeout=60)  # a slow reader: the fetches below run meanwhile
            read.update({p.name: p.read_bytes() for p in folder.iterdir()})

    def fetcher() -> None:
        store.get(blobs.digest["c"])  # evicts b, the least recently used
        store.get(blobs.digest["d"])  # a is the least recently used now, but being read: c goes

    reading = threading.Thread(target=reader)
    reading.start()
    assert holding.wait(timeout=60)
    fetching = threading.Thread(target=fetcher)
    fetching.start()
    fetching.join(timeout=120)
    assert not fetching.is_alive() and reading.is_alive()
    assert blobs.cached(store) == {"a", "d"}
    assert store.evict(blobs.digest["a"]) is False  # the worker's unload waits for the reader too
    release.set()
    reading.join(timeout=60)
    assert read == {n: p.read_bytes() for n, p in blobs.files["a"].items()}
    store.get(blobs.digest["b"])  # a is no longer held: it goes first
    assert blobs.cached(store) == {"d", "b"}
    assert store.evict(blobs.digest["d"]) is True and blobs.cached(store) == {"b"}


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_a_restarted_cache_measures_what_it_holds(
    open_store: Callable[..., BlobStore], same_size: Blobs
) -> None:
    blobs = same_size
    blobs.publish(open_store("writer"))
    first = open_store("bounded")  # unbounded
    assert isinstance(first, CachedBlobStore)
    for letter in "abc":
        first.get(blobs.digest[letter])
    now = time.time()
    for age, letter in enumerate("acb"):  # the last run used b longest ago, then c
        stamp = now - 60 * age
        os.utime(first.cache_dir / digest_hex(blobs.digest[letter]), (stamp, stamp))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    crashed = first.cache_dir / f".fetch-{ended.pid}-x"  # a fetch whose process is gone
    alive = first.cache_dir / f".fetch-{os.getppid()}-y"  # another process's fetch in flight
    for staging in (crashed, alive):
        staging.mkdir()
        (staging / WEIGHTS).write_bytes(b"partial")
    cache_dir = first.cache_dir
    del first
    gc.collect()  # this process forgets the folder, as a restarted one has never seen it

    store = open_store("bounded", max_bytes=int(2.5 * blobs.size))
    assert isinstance(store, CachedBlobStore)
    assert not crashed.exists() and alive.is_dir()
    shutil.rmtree(alive)
    assert blobs.cached(store) == {"a", "c"}  # over its bound at start: b, the oldest, went
    assert store.cache.total_bytes() == 2 * blobs.size
    store.get(blobs.digest["d"])
    assert blobs.cached(store) == {"a", "d"} and store.cache_dir == cache_dir


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_a_blob_larger_than_the_bound_still_loads(
    open_store: Callable[..., BlobStore], same_size: Blobs, base: BaseShapes, caplog: pytest.LogCaptureFixture
) -> None:
    blobs = same_size
    blobs.publish(open_store("writer"))
    store = open_store("tiny", max_bytes=blobs.size // 2)
    with caplog.at_level(logging.WARNING, logger="loraplex.adapters.blob_cache"):
        assert load_blob(store, blobs.digest["a"], base).digest == blobs.digest["a"]
    assert "larger than the adapter cache's bound" in caplog.text
    assert blobs.cached(store) == {"a"}
    with store.open(blobs.digest["a"]):
        store.get(blobs.digest["b"])  # just fetched, and a is being read: both stay for now
        assert blobs.cached(store) == {"a", "b"}
    store.get(blobs.digest["c"])
    assert blobs.cached(store) == {"c"}
    with pytest.raises(ValueError, match="must be > 0"):
        open_store("zero", max_bytes=0)


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


@parametrized
def test_digests_and_gc_marks(open_store: Callable[..., BlobStore], validated: AdapterStore) -> None:
    """Every replica lists the same blobs and sees the same garbage-collection marks,
    which are not blobs and do not disturb fetching."""
    store, other = open_store(), open_store("replica-2")
    (d1, f1), (d2, f2) = blob(validated, "v1"), blob(validated, "v2")
    assert store.digests() == set() and store.marks() == {}
    store.put(d1, f1)
    store.put(d2, f2)
    assert other.digests() == {d1, d2}
    store.mark(d1, 1234.5)
    store.mark(d1, 1234.5)  # idempotent
    assert other.marks() == {d1: 1234.5} and other.digests() == {d1, d2}
    assert load_peft_adapter(other.get(d1), validated.base).digest == d1  # a marked blob still loads
    other.unmark(d1)
    other.unmark(d2)  # not marked: no error
    assert store.marks() == {}
    store.delete(d1)
    assert other.digests() == {d2}
