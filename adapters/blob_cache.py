"""The local cache of a remote adapter store: fetched blob folders, bounded in total size.

Layout under the cache folder:

    <hex>/                   one fetched, verified blob (what `CachedBlobStore.get` returns)
    .fetch-<pid>-<random>/   a fetch being staged by process <pid> (not counted)
    .evict-<hex>-<random>/   an evicted blob being removed (already invisible to readers)

Past `max_bytes`, the least recently used blobs are removed after each fetch, never the
one just fetched and never one a reader holds (`pinned`). Recency survives restarts: a
hit refreshes the folder's mtime, and a new index orders the folders it finds by mtime.

One process per cache folder: sizes, recency and pins live in this process's memory,
shared by every store it opens on the same folder. A second process on the folder could
remove a blob this one is reading, and is not counted until it is looked up here.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import threading
import weakref
from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

STAGING_PREFIX = ".fetch-"
TRASH_PREFIX = ".evict-"


class _Index:
    """What one process knows of one cache folder: blob sizes in recency order (least
    recently used first) and the readers holding each blob. Guarded by `lock`."""

    def __init__(self, root: Path) -> None:
        self.lock = threading.Lock()
        self.sizes: OrderedDict[str, int] = OrderedDict()
        self.pins: Counter[str] = Counter()
        found = []
        for entry in os.scandir(root):
            if entry.name.startswith(STAGING_PREFIX) and _stale_staging(entry.name):
                shutil.rmtree(entry.path, ignore_errors=True)
            elif entry.name.startswith(TRASH_PREFIX):
                shutil.rmtree(entry.path, ignore_errors=True)
            elif not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False):
                found.append((entry.stat().st_mtime_ns, entry.name))
        for _, name in sorted(found):
            self.sizes[name] = folder_bytes(root / name)

    def total(self) -> int:
        return sum(self.sizes.values())


_indexes: weakref.WeakValueDictionary[Path, _Index] = weakref.WeakValueDictionary()
_indexes_lock = threading.Lock()


def _index_for(root: Path) -> _Index:
    """The process's one index of `root`, measured from the folder when first opened."""
    key = root.resolve()
    with _indexes_lock:
        index = _indexes.get(key)
        if index is None:
            index = _indexes[key] = _Index(key)
        return index


class BlobCache:
    """Blob folders `<root>/<hex>/`, at most `max_bytes` in all (None: unbounded) except
    while pinned blobs, or one blob alone, exceed it. Thread-safe; see the module docstring
    for the one-process-per-folder assumption."""

    def __init__(self, root: Path, max_bytes: int | None = None) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"an adapter cache bound must be > 0 bytes, got {max_bytes}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._index = _index_for(self.root)
        self._trim(keep=None)  # the bound may have shrunk since the folder was filled

    def path(self, hex_digest: str) -> Path:
        return self.root / hex_digest

    def total_bytes(self) -> int:
        """The bytes of the blobs this process knows are cached."""
        with self._index.lock:
            return self._index.total()

    @contextmanager
    def pinned(self, hex_digest: str) -> Iterator[None]:
        """Nothing evicts the blob while the block runs (whether or not it is cached yet)."""
        index = self._index
        with index.lock:
            index.pins[hex_digest] += 1
        try:
            yield
        finally:
            with index.lock:
                index.pins[hex_digest] -= 1
                if index.pins[hex_digest] <= 0:
                    del index.pins[hex_digest]

    def lookup(self, hex_digest: str) -> Path | None:
        """The cached folder, now the most recently used; None when it is not cached."""
        path, index = self.path(hex_digest), self._index
        with index.lock:
            if not path.is_dir():
                index.sizes.pop(hex_digest, None)
                return None
            if hex_digest not in index.sizes:  # cached by another process, or before a restart
                index.sizes[hex_digest] = folder_bytes(path)
            index.sizes.move_to_end(hex_digest)
            _touch(path)
        return path

    def staging(self) -> Path:
        """A new empty folder to fetch into, on the cache's filesystem (renamed into place)."""
        return Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=self.root))

    def added(self, hex_digest: str) -> None:
        """Count a blob just renamed into place as the most recently used, then evict the
        least recently used others until the cache fits its bound."""
        path, index = self.path(hex_digest), self._index
        size = folder_bytes(path)
        with index.lock:
            index.sizes[hex_digest] = size
            index.sizes.move_to_end(hex_digest)
            _touch(path)
        if self.max_bytes is not None and size > self.max_bytes:
            log.warning("adapter blob %s (%d bytes) is larger than the adapter cache's bound (%d bytes): "
                        "kept until the next fetch", hex_digest[:12], size, self.max_bytes)
        self._trim(keep=hex_digest)

    def evict(self, hex_digest: str) -> bool:
        """Remove the blob's folder now, unless a reader holds it (False: it stays, and the
        bound removes it once it is the least recently used)."""
        index = self._index
        with index.lock:
            if index.pins[hex_digest] > 0:
                return False
            trash = self._discard(hex_digest)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        return True

    def _trim(self, keep: str | None) -> None:
        if self.max_bytes is None:
            return
        index, trash, evicted = self._index, [], []
        with index.lock:
            total = index.total()
            for name, size in list(index.sizes.items()):
                if total <= self.max_bytes:
                    break
                if name == keep or index.pins[name] > 0:
                    continue
                total -= size
                evicted.append((name, size))
                if (moved := self._discard(name)) is not None:
                    trash.append(moved)
            over = total > self.max_bytes
        for folder in trash:  # outside the lock: lookups need not wait for the disk
            shutil.rmtree(folder, ignore_errors=True)
        if evicted:
            log.info("adapter cache: evicted %d least recently used (%s, %d bytes); %d of %d bytes cached",
                     len(evicted), ", ".join(n[:12] for n, _ in evicted), sum(b for _, b in evicted), total,
                     self.max_bytes)
        if over:
            log.info("adapter cache: %d bytes cached, over its bound of %d: the rest is being read or was "
                     "just fetched", total, self.max_bytes)

    def _discard(self, hex_digest: str) -> Path | None:
        """Under the lock: forget the blob and move its folder out of readers' sight (one
        rename, so no reader finds it half removed); the moved folder, None if it was gone."""
        self._index.sizes.pop(hex_digest, None)
        trash = self.root / f"{TRASH_PREFIX}{hex_digest[:12]}-{secrets.token_hex(4)}"
        try:
            os.rename(self.path(hex_digest), trash)
        except FileNotFoundError:
            return None
        return trash


def folder_bytes(path: Path) -> int:
    """The bytes of the files in one (flat) blob folder; 0 once it is gone."""
    total = 0
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    except FileNotFoundError:
        pass
    return total


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass  # recency then survives in memory only, until a restart


def _stale_staging(name: str) -> bool:
    """A staging folder whose process is gone (a crash mid-fetch), or this process's own
    (nothing of ours is fetching before the index exists)."""
    pid_text = name.removeprefix(STAGING_PREFIX).split("-", 1)[0]
    if not pid_text.isdigit():
        return True
    pid = int(pid_text)
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False
