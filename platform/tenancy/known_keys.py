"""The digests of every API key in the database, held in memory and kept in step with it.

The failed-authentication throttle (tenancy/throttle.py) is keyed by client address, and
behind a proxy many tenants share one. So a throttled address is not refused outright:
a key whose digest is in this set (one that exists, on this replica or another) goes on
to be checked as usual, while an unknown key from a throttled address gets 429 without
costing a database query.

The set is refreshed every `refresh_seconds` (the auth cache's TTL) with the rows added
since the last look: one indexed range query. Ids are taken from a sequence, and on
PostgreSQL a transaction may commit an id below one already seen, so each look reaches
back `LOOKBACK_IDS` ids, and the whole set is reloaded every `full_reload_seconds`. A
key created on another replica is therefore recognised here within one refresh; keys
are never deleted one by one (revoking one keeps its row), so the set only grows between
full reloads, which also forget the keys of deleted tenants.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sqlalchemy import select

from loraplex.platform.db.database import Database
from loraplex.platform.db.tables import ApiKey

LOOKBACK_IDS = 1024
FULL_RELOAD_SECONDS = 300.0


class KnownKeys:
    """Thread-safe: refreshed on a worker thread, read on the event loop."""

    def __init__(self, db: Database, full_reload_seconds: float = FULL_RELOAD_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.db = db
        self.full_reload_seconds = full_reload_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._digests: set[bytes] = set()
        self._watermark = 0  # the highest key id seen
        self._reloaded_at: float | None = None  # None: never loaded

    @property
    def loaded(self) -> bool:
        return self._reloaded_at is not None

    def __contains__(self, digest: str) -> bool:
        return bytes.fromhex(digest) in self._digests

    def __len__(self) -> int:
        return len(self._digests)

    def add(self, digest: str) -> None:
        """A key this replica just found in the database."""
        with self._lock:
            self._digests.add(bytes.fromhex(digest))

    def refresh(self) -> None:
        """Blocking: the keys added since the last refresh, or all of them when a full
        reload is due. Call it off the event loop."""
        now = self._clock()
        full = self._reloaded_at is None or now - self._reloaded_at >= self.full_reload_seconds
        since = 0 if full else max(0, self._watermark - LOOKBACK_IDS)
        with self.db.session() as s:
            rows = s.execute(select(ApiKey.id, ApiKey.secret_hash).where(ApiKey.id > since)).all()
        fresh = {bytes.fromhex(h) for _, h in rows}
        top = max((i for i, _ in rows), default=0)
        with self._lock:
            if full:
                self._digests = fresh
                self._watermark = top
                self._reloaded_at = now
            else:
                self._digests |= fresh
                self._watermark = max(self._watermark, top)
