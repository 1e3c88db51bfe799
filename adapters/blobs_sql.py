"""Adapter blobs as chunked rows of one table, in the platform's own database.

PostgreSQL is the shared store of a multi-replica deployment (SQLite works too, for one
machine). A `put` inside the caller's transaction makes publishing an adapter atomic:
the blob rows and the registry row that names its digest commit together or not at all.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Column, Integer, LargeBinary, MetaData, String, Table, delete, select
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from .blobs import BLOB_FILES, CachedBlobStore, blob_hex, check_files
from .errors import AdapterCorruptedError, AdapterNotFoundError, BlobStoreError

TABLE_NAME = "adapter_blobs"
CHUNK_BYTES = 4 << 20  # well under PostgreSQL's 1 GB bytea limit, few rows per adapter
# A garbage-collection mark is one row of its own in the same table (no schema change):
# digest "gc:<hex>", this file name, the time as text. No blob digest starts with "gc:".
MARK_PREFIX, MARK_FILE = "gc:", ".gc-mark"


def adapter_blobs_table(metadata: MetaData) -> Table:
    """The `adapter_blobs` table in `metadata` (the migration 0004 creates it)."""
    return Table(
        TABLE_NAME,
        metadata,
        Column("digest", String(71), primary_key=True),  # "sha256:" + 64 hex digits
        Column("file_name", String(64), primary_key=True),
        Column("chunk_index", Integer, primary_key=True, autoincrement=False),
        Column("data", LargeBinary, nullable=False),
    )


ADAPTER_BLOBS = adapter_blobs_table(MetaData())


class SqlBlobStore(CachedBlobStore):
    """Blobs in `adapter_blobs` (digest, file name, chunk index, bytes); see BlobStore."""

    def __init__(self, engine: Engine, cache_dir: Path, *, cache_max_bytes: int | None = None) -> None:
        super().__init__(cache_dir, cache_max_bytes)
        self.engine = engine

    def put(self, digest: str, files: Mapping[str, Path], connection: Connection | None = None) -> None:
        check_files(files)
        blob_hex(digest)
        if connection is not None:
            self._put(connection, digest, files)
            return
        with _errors(), self.engine.begin() as conn:
            self._put(conn, digest, files)

    def _put(self, conn: Connection, digest: str, files: Mapping[str, Path]) -> None:
        if _exists(conn, digest):
            return
        insert = _insert_ignoring_duplicates(conn)
        for name, path in files.items():
            with open(path, "rb") as f:
                index = 0
                # An empty file still gets its one (empty) row, so `get` knows it exists.
                while (chunk := f.read(CHUNK_BYTES)) or index == 0:
                    conn.execute(insert, {"digest": digest, "file_name": name, "chunk_index": index, "data": chunk})
                    index += 1
                    if not chunk:
                        break

    def exists(self, digest: str) -> bool:
        blob_hex(digest)
        with _errors(), self.engine.connect() as conn:
            return _exists(conn, digest)

    def delete(self, digest: str, connection: Connection | None = None) -> None:
        stmt = delete(ADAPTER_BLOBS).where(ADAPTER_BLOBS.c.digest == digest)
        if connection is not None:
            connection.execute(stmt)
            return
        with _errors(), self.engine.begin() as conn:
            conn.execute(stmt)

    def digests(self) -> set[str]:
        t = ADAPTER_BLOBS
        with _errors(), self.engine.connect() as conn:
            return set(conn.execute(select(t.c.digest).where(t.c.digest.like("sha256:%")).distinct()).scalars())

    def marks(self) -> dict[str, float]:
        t = ADAPTER_BLOBS
        query = select(t.c.digest, t.c.data).where(t.c.digest.like(f"{MARK_PREFIX}%"), t.c.file_name == MARK_FILE)
        with _errors(), self.engine.connect() as conn:
            return {"sha256:" + d.removeprefix(MARK_PREFIX): float(bytes(data)) for d, data in conn.execute(query)}

    def mark(self, digest: str, at: float) -> None:
        row = {"digest": MARK_PREFIX + blob_hex(digest), "file_name": MARK_FILE, "chunk_index": 0,
               "data": repr(at).encode()}
        with _errors(), self.engine.begin() as conn:
            conn.execute(_insert_ignoring_duplicates(conn), row)

    def unmark(self, digest: str) -> None:
        with _errors(), self.engine.begin() as conn:
            conn.execute(delete(ADAPTER_BLOBS).where(ADAPTER_BLOBS.c.digest == MARK_PREFIX + blob_hex(digest)))

    def download(self, digest: str, dest: Path) -> None:
        t = ADAPTER_BLOBS
        query = (
            select(t.c.file_name, t.c.chunk_index, t.c.data)
            .where(t.c.digest == digest)
            .order_by(t.c.file_name, t.c.chunk_index)
        )
        expected: dict[str, int] = {}  # file name -> next chunk index
        with _errors(), self.engine.connect() as conn:
            rows = conn.execution_options(yield_per=4).execute(query)
            for name, index, data in rows:
                if name not in BLOB_FILES:
                    raise AdapterCorruptedError(f"stored adapter {digest} is corrupted: unexpected file {name!r}")
                if index != expected.get(name, 0):
                    raise AdapterCorruptedError(f"stored adapter {digest} is corrupted: {name} lacks chunk {index - 1}")
                expected[name] = index + 1
                with open(dest / name, "ab") as f:
                    f.write(data)
        if not expected:
            raise AdapterNotFoundError(f"no stored adapter with digest {digest}")

@contextmanager
def _errors() -> Iterator[None]:
    """Database failures leave as BlobStoreError, so callers handle one type per store."""
    try:
        yield
    except SQLAlchemyError as e:
        raise BlobStoreError(f"the adapter blob database failed: {e.__class__.__name__}: {e}") from e


def _exists(conn: Connection, digest: str) -> bool:
    query = select(ADAPTER_BLOBS.c.chunk_index).where(ADAPTER_BLOBS.c.digest == digest).limit(1)
    return conn.execute(query).first() is not None


def _insert_ignoring_duplicates(conn: Connection) -> Any:
    # Two replicas publishing the same content race on the primary key; the loser's rows are
    # identical, so it keeps the winner's.
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert(ADAPTER_BLOBS).on_conflict_do_nothing()
