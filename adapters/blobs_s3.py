"""Adapter blobs as objects in an S3-compatible bucket (boto3), for large fleets.

Layout: `<prefix>/<hex>/<file>` for each file, then `<prefix>/<hex>/.complete` written last
(and deleted first): S3 writes one object atomically but not a set of them, so readers trust
a blob only once its marker exists, and a crashed upload is an invisible partial blob that
the next put of that digest overwrites.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from .blobs import BLOB_FILES, CachedBlobStore, blob_hex, check_files
from .errors import AdapterCorruptedError, AdapterNotFoundError, BlobStoreError

MARKER = ".complete"
GC_FOLDER = ".gc"  # <prefix>/.gc/<hex>: a garbage-collection mark, its body the time
_MISSING = ("404", "NoSuchKey", "NotFound")


class S3BlobStore(CachedBlobStore):
    """Blobs under `s3://<bucket>/<prefix>/`; see BlobStore. `connection` is ignored."""

    def __init__(
        self, bucket: str, prefix: str, cache_dir: Path, *, endpoint_url: str | None = None, client: Any = None,
        cache_max_bytes: int | None = None,
    ) -> None:
        super().__init__(cache_dir, cache_max_bytes)
        if not bucket:
            raise BlobStoreError("an s3:// adapter store URL needs a bucket: s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        # Path-style addressing works with every S3-compatible server (MinIO, moto, Ceph).
        config = Config(s3={"addressing_style": "path"}, retries={"mode": "standard"})
        self.client = client or boto3.client("s3", endpoint_url=endpoint_url, config=config)

    def _key(self, digest: str, name: str) -> str:
        return "/".join(p for p in (self.prefix, blob_hex(digest), name) if p)

    def put(self, digest: str, files: Mapping[str, Path], connection: object = None) -> None:
        check_files(files)
        if self.exists(digest):
            return
        with _errors():
            for name, path in files.items():
                self.client.upload_file(str(path), self.bucket, self._key(digest, name))
            manifest = json.dumps({"files": sorted(files)}).encode()
            self.client.put_object(Bucket=self.bucket, Key=self._key(digest, MARKER), Body=manifest)

    def exists(self, digest: str) -> bool:
        return self._manifest(digest) is not None

    def delete(self, digest: str, connection: object = None) -> None:
        with _errors():
            self.client.delete_object(Bucket=self.bucket, Key=self._key(digest, MARKER))
            keys = [{"Key": self._key(digest, n)} for n in BLOB_FILES]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})

    def _list(self, folder: str) -> Iterator[dict]:
        base = "/".join(p for p in (self.prefix, folder) if p)
        with _errors():
            for page in self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=base + "/" if base else ""):
                yield from page.get("Contents", ())

    def digests(self) -> set[str]:
        # A blob counts once its marker is written (a crashed upload has none).
        return {"sha256:" + o["Key"].split("/")[-2] for o in self._list("") if o["Key"].endswith("/" + MARKER)
                and len(o["Key"].split("/")[-2]) == 64}

    def marks(self) -> dict[str, float]:
        out = {}
        for o in self._list(GC_FOLDER):
            with _errors():
                body = self.client.get_object(Bucket=self.bucket, Key=o["Key"])["Body"].read()
            try:
                out["sha256:" + o["Key"].rsplit("/", 1)[1]] = float(body)
            except ValueError:
                continue
        return out

    def _gc_key(self, digest: str) -> str:
        return "/".join(p for p in (self.prefix, GC_FOLDER, blob_hex(digest)) if p)

    def mark(self, digest: str, at: float) -> None:
        with _errors():
            self.client.put_object(Bucket=self.bucket, Key=self._gc_key(digest), Body=repr(at).encode())

    def unmark(self, digest: str) -> None:
        with _errors():
            self.client.delete_object(Bucket=self.bucket, Key=self._gc_key(digest))

    def download(self, digest: str, dest: Path) -> None:
        manifest = self._manifest(digest)
        if manifest is None:
            raise AdapterNotFoundError(f"no stored adapter with digest {digest}")
        names = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(names, list) or not set(names) <= set(BLOB_FILES):
            raise AdapterCorruptedError(f"stored adapter {digest} is corrupted: its manifest lists {names!r}")
        with _errors():
            for name in names:
                self.client.download_file(self.bucket, self._key(digest, name), str(dest / name))

    def _manifest(self, digest: str) -> Any:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(digest, MARKER))["Body"].read()
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code")) in _MISSING:
                return None
            raise BlobStoreError(f"the adapter bucket {self.bucket!r} failed: {e}") from e
        except BotoCoreError as e:
            raise BlobStoreError(f"the adapter bucket {self.bucket!r} is unreachable: {e}") from e
        try:
            return json.loads(body)
        except ValueError:
            raise AdapterCorruptedError(f"stored adapter {digest} is corrupted: its manifest is not JSON") from None


@contextmanager
def _errors() -> Iterator[None]:
    """boto3 failures leave as BlobStoreError (a missing object inside a blob: corrupted)."""
    try:
        yield
    except ClientError as e:
        if str(e.response.get("Error", {}).get("Code")) in _MISSING:
            raise AdapterCorruptedError(f"a stored adapter's file is missing from the bucket: {e}") from e
        raise BlobStoreError(f"the adapter bucket failed: {e}") from e
    except BotoCoreError as e:
        raise BlobStoreError(f"the adapter bucket is unreachable: {e}") from e
