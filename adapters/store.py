"""The disk store of every registered adapter: content-addressed blobs plus a name index.

Layout under `root`:

    index.json           name -> current record + older versions (the only mutable file)
    blobs/<hex>/         adapter_config.json + adapter_model.safetensors + the resolved
                         targets, immutable (a `blobs.LocalBlobStore`)
    tmp/                 staging for adds and deletions in flight
    .lock                flock'd around every index change, so processes can share a root

Crash safety: an add validates a private copy in tmp/, publishes it with one rename into
blobs/, then swaps index.json with os.replace. A crash before the swap leaves at most an
unreferenced blob, invisible to readers and removed by the next prune. Deletion renames a
blob into tmp/ before removing it, so a blob folder is always either whole or absent.
"""
from __future__ import annotations

import builtins
import dataclasses
import fcntl
import json
import os
import re
import shutil
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .blobs import BLOB_FILES, LocalBlobStore, copy_fsync, fsync_dir
from .digest import DIGEST_PREFIX, digest_hex
from .errors import (
    AdapterError,
    AdapterNotFoundError,
    AdapterTooLargeError,
    AdapterValidationError,
    InvalidAdapterNameError,
)
from .features import adapter_features
from .limits import MAX_CONFIG_BYTES, max_adapter_bytes
from .peft import (
    CONFIG_NAME,
    DEFAULT_MAX_RANK,
    WEIGHTS_NAME,
    LoRAAdapter,
    find_adapter_files,
    load_peft_adapter,
    write_resolved_targets,
)
from .shapes import BaseShapes
from .zipsafe import extract_adapter_zip

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_INDEX_FORMAT = 1
_STALE_TMP_SECONDS = 3600.0


@dataclass(frozen=True)
class AdapterRecord:
    name: str
    digest: str
    rank: int
    target_modules: tuple[str, ...]
    alpha: float
    size_bytes: int  # on disk: config + safetensors
    created_at: float  # unix seconds
    # Its kind (`features.adapter_features`); None for a version recorded before kinds were.
    features: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules)
        d["features"] = None if self.features is None else list(self.features)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> AdapterRecord:
        features = d.get("features")
        return cls(**{**d, "target_modules": tuple(d["target_modules"]),
                      "features": None if features is None else tuple(features)})


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name in (".", ".."):
        raise InvalidAdapterNameError(
            f"invalid adapter name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


class AdapterStore:
    """Every registered adapter, by name, with older versions kept loadable by digest."""

    def __init__(
        self,
        root: str | Path,
        base: BaseShapes,
        *,
        max_rank: int = DEFAULT_MAX_RANK,
        keep_versions: int = 4,
        max_file_bytes: int | None = None,
    ) -> None:
        self.root = Path(root)
        self.base = base
        self.max_rank = max_rank
        self.keep_versions = keep_versions  # older versions kept per name, beyond the current one
        # The weights file's cap: by default, what an adapter for `base` at `max_rank` can weigh.
        self.max_file_bytes = max_file_bytes if max_file_bytes is not None else max_adapter_bytes(base, max_rank)
        self.blobs = LocalBlobStore(self.root)
        self._blobs = self.blobs.blobs
        self._tmp = self.blobs.tmp
        self._index_path = self.root / "index.json"
        self._thread_lock = threading.RLock()

    # ---- reads -------------------------------------------------------------------------

    def get(self, name: str) -> AdapterRecord:
        entry = self._read_index().get(validate_name(name))
        if entry is None:
            raise AdapterNotFoundError(f"no adapter named {name!r}")
        return AdapterRecord.from_json(entry["current"])

    def list(self) -> list[AdapterRecord]:
        index = self._read_index()
        return [AdapterRecord.from_json(index[n]["current"]) for n in sorted(index)]

    def versions(self, name: str) -> builtins.list[AdapterRecord]:
        """The current version first, then the older ones still kept, newest first."""
        entry = self._read_index().get(validate_name(name))
        if entry is None:
            raise AdapterNotFoundError(f"no adapter named {name!r}")
        return [AdapterRecord.from_json(r) for r in [entry["current"], *entry["history"]]]

    def path_of(self, digest: str) -> Path:
        path = self.blobs.path(digest)
        if not path.is_dir():
            raise AdapterNotFoundError(f"no stored adapter with digest {digest}")
        return path

    def blob_files(self, digest: str) -> dict[str, Path]:
        """The stored files of a version, as `BlobStore.put` takes them (to share the blob)."""
        path = self.path_of(digest)
        return {n: path / n for n in BLOB_FILES if (path / n).is_file()}

    def load(self, name_or_digest: str, dtype: torch.dtype = torch.float32) -> LoRAAdapter:
        """Load by name (its current version) or by digest (any version still stored)."""
        if name_or_digest.startswith(DIGEST_PREFIX):
            digest = name_or_digest
        else:
            digest = self.get(name_or_digest).digest
        path = self.path_of(digest)
        try:
            adapter = load_peft_adapter(path, self.base, dtype, max_rank=self.max_rank)
        except AdapterValidationError:
            if not path.exists():  # pruned while we read it
                raise AdapterNotFoundError(f"no stored adapter with digest {digest}") from None
            raise
        if adapter.digest != digest:
            raise AdapterError(f"stored adapter {digest} is corrupted: its content digests to {adapter.digest}")
        return adapter

    # ---- writes ------------------------------------------------------------------------

    def add(self, name: str, source: str | Path, *, replace: bool = False) -> AdapterRecord:
        """Validate a PEFT folder or .zip and register it under `name`, all or nothing."""
        validate_name(name)
        if not replace and name in self._read_index():
            raise AdapterError(f"adapter {name!r} already exists (pass replace=True for a new version)")
        staging = Path(tempfile.mkdtemp(prefix="add-", dir=self._tmp))
        try:
            blob = self._stage(Path(source), staging)
            adapter = load_peft_adapter(
                blob, self.base, max_rank=self.max_rank, max_weights_bytes=self.max_file_bytes
            )
            size = sum((blob / n).stat().st_size for n in (CONFIG_NAME, WEIGHTS_NAME))
            write_resolved_targets(blob, adapter)
            fsync_dir(blob)
            record = AdapterRecord(
                name=name,
                digest=adapter.digest,
                rank=adapter.rank,
                target_modules=adapter.target_modules,
                alpha=adapter.alpha,
                size_bytes=size,
                created_at=time.time(),
                features=adapter_features(adapter),
            )
            with self._locked():
                return self._commit(record, blob, replace)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def remove(self, name: str) -> None:
        """Unregister `name` and every kept version; blobs no other name uses are deleted."""
        validate_name(name)
        with self._locked():
            index = self._read_index()
            if index.pop(name, None) is None:
                raise AdapterNotFoundError(f"no adapter named {name!r}")
            self._write_index(index)
            self._prune(index)

    def gc(self) -> None:
        """Delete unreferenced blobs and staging left by crashed processes."""
        with self._locked():
            self._prune(self._read_index())
            cutoff = time.time() - _STALE_TMP_SECONDS
            for p in self._tmp.iterdir():
                if p.lstat().st_mtime < cutoff:
                    _remove_path(p)

    # ---- internals ---------------------------------------------------------------------

    def _commit(self, record: AdapterRecord, blob: Path, replace: bool) -> AdapterRecord:
        index = self._read_index()
        entry = index.get(record.name)
        if entry is not None and not replace:
            raise AdapterError(f"adapter {record.name!r} already exists (pass replace=True for a new version)")
        if entry is not None and entry["current"]["digest"] == record.digest:
            return self._same_content(index, entry, record)
        published = self.blobs.adopt(record.digest, blob)
        history = [] if entry is None else [entry["current"], *entry["history"]][: self.keep_versions]
        index[record.name] = {"current": record.to_json(), "history": history}
        try:
            self._write_index(index)
        except BaseException:
            if published:
                self.blobs.delete(record.digest)
            raise
        self._prune(index)
        return record

    def _same_content(self, index: dict[str, Any], entry: dict[str, Any], record: AdapterRecord) -> AdapterRecord:
        """The current version, unchanged; only its kind is filled in when it was recorded
        before versions kept one."""
        current = AdapterRecord.from_json(entry["current"])
        if current.features is None:
            current = dataclasses.replace(current, features=record.features)
            entry["current"] = current.to_json()
            self._write_index(index)
        return current

    def _stage(self, source: Path, staging: Path) -> Path:
        """Write the adapter's two files into staging/blob (fsync'd, size-capped); return it."""
        blob = staging / "blob"
        blob.mkdir()
        if source.is_dir():
            config, weights = find_adapter_files(source)
            caps = ((config, CONFIG_NAME, MAX_CONFIG_BYTES), (weights, WEIGHTS_NAME, self.max_file_bytes))
            for src, dst_name, cap in caps:
                if (size := src.stat().st_size) > cap:
                    raise AdapterTooLargeError(f"{dst_name} is {size} bytes, over the {cap} byte limit")
                copy_fsync(src, blob / dst_name)
        elif source.is_file() and zipfile.is_zipfile(source):
            extract_adapter_zip(source, blob, max_weights_bytes=self.max_file_bytes)
        elif source.exists():
            raise AdapterValidationError(f"{source.name} is neither a PEFT adapter folder nor a .zip of one")
        else:
            raise AdapterValidationError(f"adapter source {source} does not exist")
        return blob

    def _prune(self, index: dict[str, Any]) -> None:
        referenced = {
            digest_hex(r["digest"]) for e in index.values() for r in [e["current"], *e["history"]]
        }
        for blob in self._blobs.iterdir():
            if blob.name in referenced:
                continue
            if _is_hex_name(blob.name):
                self.blobs.delete(DIGEST_PREFIX + blob.name)
            else:  # not a blob at all: nothing reads it
                _remove_path(blob)

    def _read_index(self) -> dict[str, Any]:
        try:
            data = json.loads(self._index_path.read_text())
        except FileNotFoundError:
            return {}
        except ValueError as e:
            # Never treat a damaged index as empty: the next write would forget every adapter.
            raise AdapterError(f"adapter index {self._index_path} is corrupted: {e}") from None
        if not isinstance(data, dict) or data.get("format") != _INDEX_FORMAT:
            raise AdapterError(f"adapter index {self._index_path} is not a format-{_INDEX_FORMAT} index")
        adapters: dict[str, Any] = data["adapters"]
        return adapters

    def _write_index(self, adapters: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".index-", suffix=".tmp", dir=self.root)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"format": _INDEX_FORMAT, "adapters": adapters}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._index_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(self.root)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock, open(self.root / ".lock", "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _is_hex_name(name: str) -> bool:
    try:
        digest_hex(DIGEST_PREFIX + name)
        return True
    except ValueError:
        return False
