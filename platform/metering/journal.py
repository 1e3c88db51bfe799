"""The usage journal: an fsync'd, append-only local log of usage records, one per process.

A record is durable once `durable(lsn)` returns: it was written and fsync'd. Records are
framed with their length and checksum (frames.py), so a torn tail (a crash mid-write) is
dropped at replay and a damaged frame loses only itself. Appends from any thread go to
one buffer; a committer thread writes the whole buffer and fsyncs once (group commit): a
burst of N records costs one fsync, not N.

The journal is a series of segment files `usage-<owner>-<seq>.journal` beside a lock
file `usage-<owner>.lock` that the owning process holds (`flock`) for its lifetime. The
current segment is replaced by a new one past `max_segment_bytes`. Callers pin a segment
while it holds something not yet safe elsewhere (an event not yet in the database, an
open request's latest checkpoint); a closed segment with no pins is deleted.

`orphans()` finds the segments of dead owners (their lock file is gone or free to
lock): the kernel drops a `kill -9`'d or OOM-killed process's lock, so a restart (or
any other process on the same data dir) claims its journal. A journal is bound to the
database its events belong to (`bind`: the database's identity, kept in its lock
file), and only a process bound to the same database claims it: a data dir reused with
another database never bills that database's tenants (tenant ids are per database) for
the first one's requests. A journal written before binding existed names none and is
claimed by any.
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.platform.metering.frames import frame, read_records

log = logging.getLogger(__name__)


class JournalError(Exception):
    """The journal cannot be written (disk full, I/O error): nothing more is acknowledged."""


@dataclass
class _Segment:
    seq: int
    path: Path
    pins: int = 0
    closed: bool = False


@dataclass
class Orphan:
    """The journal of a dead process, locked by the claimer until `release()`."""

    owner: str
    segments: list[Path]
    _lock_fd: int | None = field(default=None, repr=False)
    _lock_path: Path | None = field(default=None, repr=False)

    skipped_bytes: int = 0
    skipped_records: int = 0

    def records(self) -> Iterator[dict]:
        for path in self.segments:
            seg = read_records(path)
            if seg.skipped_bytes:
                self.skipped_bytes += seg.skipped_bytes
                self.skipped_records += seg.skipped_records
                log.error("usage journal %s: skipped %d damaged bytes (%d records) and kept the %d valid records "
                          "around them", path, seg.skipped_bytes, seg.skipped_records, len(seg.records))
            if seg.torn_bytes:
                log.warning("usage journal %s: dropped a torn or damaged tail of %d bytes after %d records",
                            path, seg.torn_bytes, len(seg.records))
            yield from seg.records

    def release(self, delete: bool) -> None:
        """Delete the segments (their records are safe elsewhere now) or just unlock."""
        if delete:
            for path in self.segments:
                path.unlink(missing_ok=True)
            if self._lock_path is not None:
                self._lock_path.unlink(missing_ok=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


class Journal:
    def __init__(self, directory: Path, owner: str, max_segment_bytes: int = 8 << 20) -> None:
        self.dir = Path(directory)
        self.owner = owner
        self.max_segment_bytes = max_segment_bytes
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_path = self.dir / f"usage-{owner}.lock"
        fd = None
        while fd is None:
            fd = _lock(self._lock_path, blocking=True)
        self._lock_fd = fd
        self._mu = threading.Lock()
        self._cond = threading.Condition(self._mu)
        self._buf: list[tuple[int, bytes]] = []  # (segment seq, framed record)
        self._segments: dict[int, _Segment] = {}
        self._seq = 0
        self._seg_bytes = 0
        self._new_segment()
        self._fd: int | None = None
        self._fd_seq = -1
        self._lsn = 0  # last appended
        self.durable_lsn = 0  # last fsync'd
        self.error: JournalError | None = None
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._stop = False
        self.database = ""  # unbound: claims every orphan
        self._foreign: set[str] = set()  # owners of other databases' journals, reported once
        self.fsyncs = 0
        self._thread = threading.Thread(target=self._run, name="loraplex-usage-journal", daemon=True)
        self._thread.start()

    # -- appending ---------------------------------------------------------------------
    def _new_segment(self) -> None:
        self._seq += 1
        self._segments[self._seq] = _Segment(self._seq, self.dir / f"usage-{self.owner}-{self._seq:06d}.journal")
        self._seg_bytes = 0

    def append(self, record: dict, pins: int = 0) -> tuple[int, int]:
        """Queue `record` for the next group commit; returns (lsn, segment), the segment
        pinned `pins` times (see `unpin`). Raises JournalError once the disk failed."""
        data = frame(record)
        with self._cond:
            if self.error is not None:
                raise self.error
            if self._seg_bytes >= self.max_segment_bytes:
                self._segments[self._seq].closed = True
                self._new_segment()
            seg = self._seq
            self._segments[seg].pins += pins
            self._seg_bytes += len(data)
            self._lsn += 1
            self._buf.append((seg, data))
            self._cond.notify()
            return self._lsn, seg

    def pin(self, seg: int) -> None:
        with self._mu:
            self._segments[seg].pins += 1

    def unpin(self, seg: int, n: int = 1) -> None:
        """What the segment held is safe elsewhere now; a closed segment left with no pins
        is deleted."""
        with self._mu:
            s = self._segments[seg]
            s.pins -= n
            assert s.pins >= 0, "journal segment unpinned more than pinned"
            drop = s.closed and s.pins == 0 and seg < self._fd_seq
            if drop:
                del self._segments[seg]
        if drop:
            s.path.unlink(missing_ok=True)

    def current_segment(self) -> int:
        return self._seq

    def pinned(self) -> int:
        with self._mu:
            return sum(s.pins for s in self._segments.values())

    # -- durability ----------------------------------------------------------------------
    async def durable(self, lsn: int) -> None:
        """Return once record `lsn` is fsync'd; raise JournalError if it never will be."""
        if self.durable_lsn >= lsn:
            return
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._mu:
            if self.error is not None:
                raise self.error
            if self.durable_lsn >= lsn:
                return
            self._waiters.append((lsn, loop, fut))
        await fut

    def wait_durable(self, lsn: int, timeout: float = 30.0) -> bool:
        """`durable` for threads (tests, benchmarks)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.durable_lsn >= lsn or self.error is not None, timeout) \
                and self.error is None

    # -- the committer -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._buf or self._stop)
                if not self._buf and self._stop:
                    return
                buf, self._buf = self._buf, []
                upto = self._lsn
            try:
                self._write(buf)
            except OSError as exc:
                self._fail(JournalError(f"the usage journal in {self.dir} cannot be written: {exc}"))
                return
            with self._cond:
                self.durable_lsn = upto
                self.fsyncs += 1
                ready = [w for w in self._waiters if w[0] <= upto]
                self._waiters = [w for w in self._waiters if w[0] > upto]
                self._cond.notify_all()
            for _lsn, loop, fut in ready:
                _resolve(loop, fut, None)

    def _write(self, buf: list[tuple[int, bytes]]) -> None:
        i = 0
        while i < len(buf):
            seg = buf[i][0]
            j = i
            while j < len(buf) and buf[j][0] == seg:
                j += 1
            if seg != self._fd_seq:
                self._switch(seg)
            data = memoryview(b"".join(d for _s, d in buf[i:j]))
            while data:  # a short write (the disk filling up) is followed by one that raises
                data = data[os.write(self._fd, data):]
            i = j
        os.fsync(self._fd)

    def _switch(self, seg: int) -> None:
        """Move to segment `seg`: the old file is complete and fsync'd first."""
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
        old = self._fd_seq
        self._fd = os.open(self._segments[seg].path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._fd_seq = seg
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)  # the new file's name is durable too
        finally:
            os.close(dfd)
        with self._mu:
            s = self._segments.get(old)
            drop = s is not None and s.closed and s.pins == 0
            if drop:
                del self._segments[old]
        if drop:
            s.path.unlink(missing_ok=True)

    def _fail(self, err: JournalError) -> None:
        log.error("%s", err)
        with self._cond:
            self.error = err
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        for _lsn, loop, fut in waiters:
            _resolve(loop, fut, err)

    def close(self, delete_if_empty: bool = True) -> bool:
        """Commit what is queued and stop. Deletes the files when nothing is pinned (all
        safe elsewhere); returns whether it did."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        empty = self.pinned() == 0 and self.error is None
        if empty and delete_if_empty:
            for s in self._segments.values():
                s.path.unlink(missing_ok=True)
            self._lock_path.unlink(missing_ok=True)
        os.close(self._lock_fd)
        return empty

    # -- recovery ------------------------------------------------------------------------
    def bind(self, database: str) -> None:
        """Bind this journal to `database` (its identity) before anything is appended: a
        dead owner's journal is then claimed only by a process bound to the same one."""
        data = database.encode()
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, data, 0)
        os.fsync(self._lock_fd)
        self.database = database

    def orphans(self) -> list[Orphan]:
        """Journals in this folder whose owner is dead and that belong to this journal's
        database (or name none), each locked for the caller."""
        owners: dict[str, list[Path]] = {}
        for path in sorted(self.dir.glob("usage-*.journal")):
            owner = path.name[len("usage-"):].rsplit("-", 1)[0]
            if owner != self.owner:
                owners.setdefault(owner, []).append(path)
        for lock_path in self.dir.glob("usage-*.lock"):
            owner = lock_path.name[len("usage-"):-len(".lock")]
            if owner != self.owner and owner not in owners:
                owners[owner] = []  # nothing left to recover: its lock file goes once free
        out = []
        for owner, segments in owners.items():
            lock_path = self.dir / f"usage-{owner}.lock"
            fd = _lock(lock_path, blocking=False)
            if fd is None:
                continue  # alive (or being claimed by another process)
            segments = [p for p in segments if p.exists()]  # another claimer may have finished first
            theirs = os.pread(fd, 256, 0).decode(errors="replace")
            if segments and self.database and theirs and theirs != self.database:
                os.close(fd)  # left for a process of its own database
                if owner not in self._foreign:
                    self._foreign.add(owner)
                    log.warning("usage journal of %s in %s belongs to another database (%s); left for it",
                                owner, self.dir, theirs)
                continue
            if not segments:
                lock_path.unlink(missing_ok=True)
                os.close(fd)
                continue
            out.append(Orphan(owner, segments, fd, lock_path))
        return out


def _lock(path: Path, blocking: bool) -> int | None:
    """An fd holding `flock` on the file at `path`, or None if another process holds it
    (`blocking`: wait for it) or `path` was removed or replaced meanwhile (a claimer
    deleting a dead owner's lock file): the caller tries again or skips."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            return fd
    except (BlockingIOError, FileNotFoundError):
        pass
    os.close(fd)
    return None


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, err: BaseException | None) -> None:
    def done() -> None:
        if not fut.done():
            fut.set_exception(err) if err is not None else fut.set_result(None)
    try:
        loop.call_soon_threadsafe(done)
    except RuntimeError:
        pass  # the waiter's loop is closed
