"""Adapter blobs by content digest, in a store every replica reaches.

A blob is the folder of one validated adapter (`adapter_config.json`,
`adapter_model.safetensors`, and the resolved targets `loraplex_targets.json`), keyed by
the digest `load_peft_adapter` computes for it. The store is chosen once, from a URL:

    /path or file:///path           LocalBlobStore: <path>/blobs/<hex>/ (serve's default)
    postgresql://... | sqlite:///.. SqlBlobStore: chunked rows of the `adapter_blobs` table
    s3://bucket/prefix              S3BlobStore: objects <prefix>/<hex>/<file>, boto3

Remote stores fetch a blob on first `get`, verify its digest, and keep it in a local cache
folder under its digest (`blob_cache.BlobCache`: bounded by `cache_max_bytes`, least
recently used out first, never a blob being read). A replace publishes a new digest, so a
version in use on a worker keeps its own folder while the new one is fetched beside it.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from .blob_cache import BlobCache
from .digest import adapter_digest, digest_hex
from .errors import AdapterCorruptedError, AdapterNotFoundError, BlobStoreError
from .peft import (
    CONFIG_NAME,
    DEFAULT_MAX_RANK,
    TARGETS_NAME,
    WEIGHTS_NAME,
    LoRAAdapter,
    load_peft_adapter,
    normalized_tensor_name,
    read_adapter_config,
)
from .shapes import BaseShapes

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection, Engine

BLOB_FILES: tuple[str, ...] = (CONFIG_NAME, WEIGHTS_NAME, TARGETS_NAME)
REQUIRED_FILES: tuple[str, ...] = (CONFIG_NAME, WEIGHTS_NAME)


@dataclass(frozen=True)
class BlobStoreConfig:
    url: str  # see the module docstring
    cache_dir: Path | None = None  # where remote stores keep fetched blobs
    s3_endpoint_url: str | None = None  # an S3-compatible server; None: AWS (or AWS_ENDPOINT_URL)
    # The most bytes of fetched blobs a remote store keeps in cache_dir; None: unbounded.
    cache_max_bytes: int | None = None


class BlobStore(ABC):
    """Adapter blobs keyed by content digest (`sha256:<hex>`).

    Contract, for every implementation:
    - `put(digest, files, connection=None)` stores `files` ({file name: local path}; names
      from BLOB_FILES, config and weights required) under `digest`, atomically (a reader
      sees every file or no blob) and idempotently (a digest already stored is left as it
      is). The caller vouches that the files are a validated adapter with that digest.
      `connection` is a SQLAlchemy Connection inside the caller's transaction; stores
      outside that database ignore it.
    - `get(digest)` returns a local folder holding the blob's files, verified to hash to
      `digest`; the folder is never modified afterwards, but a remote store's bounded
      cache may remove it later. AdapterNotFoundError when absent, AdapterCorruptedError
      when the stored bytes do not hash to `digest`.
    - `open(digest)` is `get` as a context manager: the folder stays whole until the block
      ends. Whoever reads the files uses it.
    - `exists(digest)` says whether `get` would find the blob (without fetching it).
    - `delete(digest)` removes the blob from the store; a missing blob is no error. A
      folder `get` already returned in another process may stay readable in its cache.
    - `digests()` lists every stored blob's digest.
    - `marks()`, `mark(digest, at)`, `unmark(digest)`: garbage-collection marks, kept in
      the store so every replica (and the CLI) sees them: {digest: the time (epoch
      seconds) it was first seen unreferenced}. A mark is not a blob; `unmark` of an
      unmarked digest is no error.
    Any method may raise BlobStoreError when the store is unreachable.
    """

    @abstractmethod
    def put(self, digest: str, files: Mapping[str, Path], connection: Connection | None = None) -> None: ...

    @abstractmethod
    def get(self, digest: str) -> Path: ...

    @contextmanager
    def open(self, digest: str) -> Iterator[Path]:
        yield self.get(digest)

    @abstractmethod
    def exists(self, digest: str) -> bool: ...

    @abstractmethod
    def delete(self, digest: str, connection: Connection | None = None) -> None: ...

    @abstractmethod
    def digests(self) -> set[str]: ...

    @abstractmethod
    def marks(self) -> dict[str, float]: ...

    @abstractmethod
    def mark(self, digest: str, at: float) -> None: ...

    @abstractmethod
    def unmark(self, digest: str) -> None: ...


def open_blob_store(config: BlobStoreConfig, *, engine: Engine | None = None) -> BlobStore:
    """The store `config.url` names. `engine`: reuse the caller's engine for a database URL."""
    url = config.url
    if url.startswith("s3://"):
        from .blobs_s3 import S3BlobStore

        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        return S3BlobStore(bucket, prefix, _cache_dir(config), endpoint_url=config.s3_endpoint_url,
                           cache_max_bytes=config.cache_max_bytes)
    if url.startswith(("postgresql", "sqlite:")):
        from .blobs_sql import SqlBlobStore

        return SqlBlobStore(engine if engine is not None else _engine(url), _cache_dir(config),
                            cache_max_bytes=config.cache_max_bytes)
    if "://" in url and not url.startswith("file://"):
        raise BlobStoreError(f"unsupported adapter store URL {url!r}: use a folder, postgresql://, sqlite:/// or s3://")
    return LocalBlobStore(Path(url.removeprefix("file://")))


def load_blob(
    store: BlobStore, digest: str, base: BaseShapes, dtype: torch.dtype = torch.float32, *,
    max_rank: int = DEFAULT_MAX_RANK,
) -> LoRAAdapter:
    """Fetch (on first use), verify and load one adapter version: what a worker calls per digest.
    The blob stays open while its files are read, so a bounded cache cannot evict it midway."""
    with store.open(digest) as folder:
        adapter = load_peft_adapter(folder, base, dtype, max_rank=max_rank)
    if adapter.digest != digest:
        raise AdapterCorruptedError(f"stored adapter {digest} is corrupted: its content digests to {adapter.digest}")
    return adapter


def verify_blob(folder: Path, digest: str) -> None:
    """Raise AdapterCorruptedError unless the adapter in `folder` hashes to `digest`."""
    try:
        raw = read_adapter_config(folder / CONFIG_NAME)
        tensors = load_file(folder / WEIGHTS_NAME, device="cpu")
        actual = adapter_digest(raw, {normalized_tensor_name(n): t for n, t in tensors.items()})
    except Exception as e:  # ours, OSError, and safetensors' own error types for damaged files
        raise AdapterCorruptedError(f"stored adapter {digest} is corrupted: {e}") from None
    if actual != digest:
        raise AdapterCorruptedError(f"stored adapter {digest} is corrupted: its content digests to {actual}")


def blob_hex(digest: str) -> str:
    try:
        return digest_hex(digest)
    except ValueError as e:
        raise AdapterNotFoundError(str(e)) from None


def check_files(files: Mapping[str, Path]) -> None:
    unknown = sorted(set(files) - set(BLOB_FILES))
    missing = [n for n in REQUIRED_FILES if n not in files]
    assert not unknown and not missing, f"blob files: unknown {unknown}, missing {missing}"


class LocalBlobStore(BlobStore):
    """Blobs in `<root>/blobs/<hex>/`, staged in `<root>/tmp/` and published by one rename;
    garbage-collection marks are files `<root>/gc/<hex>` holding the time."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.blobs = self.root / "blobs"
        self.tmp = self.root / "tmp"
        self.gc = self.root / "gc"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(exist_ok=True)
        self._verified: set[str] = set()

    def digests(self) -> set[str]:
        return {f"sha256:{p.name}" for p in self.blobs.iterdir() if p.is_dir() and len(p.name) == 64}

    def marks(self) -> dict[str, float]:
        out = {}
        for p in self.gc.glob("*") if self.gc.is_dir() else ():
            try:
                out[f"sha256:{p.name}"] = float(p.read_text())
            except (OSError, ValueError):
                continue  # being written or removed: read again at the next pass
        return out

    def mark(self, digest: str, at: float) -> None:
        self.gc.mkdir(exist_ok=True)
        (self.gc / blob_hex(digest)).write_text(repr(at))

    def unmark(self, digest: str) -> None:
        (self.gc / blob_hex(digest)).unlink(missing_ok=True)

    def path(self, digest: str) -> Path:
        """Where the blob lives (or would), unverified."""
        return self.blobs / blob_hex(digest)

    def put(self, digest: str, files: Mapping[str, Path], connection: Connection | None = None) -> None:
        check_files(files)
        if self.exists(digest):
            return
        staging = Path(tempfile.mkdtemp(prefix="put-", dir=self.tmp))
        try:
            for name, src in files.items():
                copy_fsync(Path(src), staging / name)
            fsync_dir(staging)
            self.adopt(digest, staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def adopt(self, digest: str, folder: Path) -> bool:
        """Move a staged blob folder (on this filesystem) into place; False if already stored."""
        dst = self.path(digest)
        if dst.exists():
            return False
        try:
            os.rename(folder, dst)
        except OSError:
            if dst.is_dir():  # a concurrent put of the same digest won
                return False
            raise
        fsync_dir(self.blobs)
        return True

    def get(self, digest: str) -> Path:
        path = self.path(digest)
        if not path.is_dir():
            raise AdapterNotFoundError(f"no stored adapter with digest {digest}")
        if digest not in self._verified:
            verify_blob(path, digest)
            self._verified.add(digest)
        return path

    def exists(self, digest: str) -> bool:
        return self.path(digest).is_dir()

    def delete(self, digest: str, connection: Connection | None = None) -> None:
        path = self.path(digest)
        if not path.exists():
            return
        # Rename first: the blob vanishes atomically, never half-deleted under its real name.
        trash = Path(tempfile.mkdtemp(prefix="del-", dir=self.tmp))
        try:
            os.rename(path, trash / "blob")
        except FileNotFoundError:
            pass  # a concurrent delete won
        fsync_dir(self.blobs)
        shutil.rmtree(trash, ignore_errors=True)
        self._verified.discard(digest)


class CachedBlobStore(BlobStore):
    """A remote store's `get`: fetch once into `<cache_dir>/<hex>/`, verified, by one rename.

    Concurrent fetchers (threads or processes) each stage their own copy; the first rename
    wins and the others drop theirs, so a cached folder is always whole and verified.
    `cache_max_bytes` bounds the cache (see `BlobCache`, which assumes one process per
    cache folder): after a fetch, least recently used blobs that nobody has `open` are
    removed until it fits, never the one just fetched.
    """

    def __init__(self, cache_dir: Path, cache_max_bytes: int | None = None) -> None:
        self.cache = BlobCache(Path(cache_dir), cache_max_bytes)
        self.cache_dir = self.cache.root

    @abstractmethod
    def download(self, digest: str, dest: Path) -> None:
        """Write the blob's files into the empty folder `dest`; AdapterNotFoundError if absent."""

    def get(self, digest: str) -> Path:
        hex_digest = blob_hex(digest)
        return self.cache.lookup(hex_digest) or self._fetch(digest, hex_digest)

    @contextmanager
    def open(self, digest: str) -> Iterator[Path]:
        # Pinned before the lookup: a concurrent fetch's eviction cannot slip in between.
        with self.cache.pinned(blob_hex(digest)):
            yield self.get(digest)

    def _fetch(self, digest: str, hex_digest: str) -> Path:
        final = self.cache.path(hex_digest)
        staging = self.cache.staging()
        try:
            self.download(digest, staging)
            missing = [n for n in REQUIRED_FILES if not (staging / n).is_file()]
            if missing:
                raise AdapterCorruptedError(f"stored adapter {digest} is corrupted: {missing[0]} is missing")
            verify_blob(staging, digest)
            fsync_dir(staging)
            try:
                os.rename(staging, final)
            except OSError:
                if not final.is_dir():
                    raise
            else:
                fsync_dir(self.cache_dir)
            self.cache.added(hex_digest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return final

    def evict(self, digest: str) -> bool:
        """Drop the local copy (the store keeps the blob), unless a reader has it open
        (False: it stays until the cache's bound removes it)."""
        return self.cache.evict(blob_hex(digest))


def copy_fsync(src: Path, dst: Path) -> None:
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
        fout.flush()
        os.fsync(fout.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cache_dir(config: BlobStoreConfig) -> Path:
    if config.cache_dir is None:
        raise BlobStoreError(f"the adapter store {config.url!r} is remote: give it a local cache folder")
    return config.cache_dir


def _engine(url: str) -> Any:
    from sqlalchemy import create_engine

    if url.startswith(("postgresql://", "postgres://")):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    return create_engine(url, pool_pre_ping=True)
