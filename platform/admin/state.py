"""The admin API's shared state (`AdminState`, built once in the app's lifespan) and the
helpers every section of the admin API uses (see routes.py for the route table)."""
from __future__ import annotations

import asyncio
import functools
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.adapters import AdapterStore
from loraplex.adapters.blobs import BlobStore

from loraplex.platform.tenancy import audit
from loraplex.platform.tenancy.adapter_registry import open_store, shared_blob_store
from loraplex.platform.tenancy.blob_gc import collect_blobs
from loraplex.platform.admin.auth import Admin, AdminAuth
from loraplex.platform.admin.failed_auth import FailureAudit
from loraplex.platform.db.database import Database
from loraplex.platform.http import no_store_json as json_response  # noqa: F401 (admin/adapters.py imports it here)
from loraplex.platform.serving.gateway import Gateway
from loraplex.platform.settings import Settings

# One logger for the whole admin API.
log = logging.getLogger("loraplex.platform.admin")


# -- state -------------------------------------------------------------------------------

@dataclass
class AdminState:
    settings: Settings
    db: Database
    gateway: Gateway
    auth: AdminAuth
    store: AdapterStore
    failures: FailureAudit | None = None  # failed sign-ins and Bearer tokens, aggregated
    _collector: asyncio.Task | None = None

    @classmethod
    def create(cls, settings: Settings, db: Database, gateway: Gateway) -> AdminState:
        """Built in the app's lifespan; a bad admin token setting stops the server there."""
        # The folder the engine serves adapters from: an upload is servable at once.
        store = open_store(settings)
        _clean_stale_uploads(store.root / "uploads")
        auth = AdminAuth.from_settings(settings, db)
        if not auth.configured:
            log.warning("admin API: no admin token configured (set $LORAPLEX_ADMIN_TOKEN); /admin is locked")
        st = cls(settings, db, gateway, auth, store)
        st.failures = FailureAudit(lambda actor, action, target, details: st.audit(actor, action, target, **details),
                                   settings.admin.audit_failure_window)
        return st

    def start(self) -> None:
        """Collect unreferenced blobs of the shared store every `adapter_gc_interval_seconds`."""
        if self.settings.adapter_gc_interval_seconds > 0 and self._collector is None:
            self._collector = asyncio.get_running_loop().create_task(self._collect_periodically())

    async def _collect_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.settings.adapter_gc_interval_seconds)
            try:
                if self.blobs is not None:
                    await asyncio.to_thread(collect_blobs, self.db, self.blobs, self.settings.adapter_gc_grace_seconds)
            except Exception as exc:  # noqa: BLE001 - a store or database blip: the next pass retries
                log.warning("adapter blob collection failed (retried in %g s): %s",
                            self.settings.adapter_gc_interval_seconds, exc)

    async def close(self) -> None:
        """Stop collecting; write the failure windows still open."""
        if self._collector is not None:
            self._collector.cancel()
            await asyncio.gather(self._collector, return_exceptions=True)
            self._collector = None
        if self.failures is not None:
            await self.failures.close()

    @functools.cached_property
    def blobs(self) -> BlobStore | None:
        """The adapter store every replica and worker shares (None: this process serves
        from its own folder only); opened on first use, kept for the process."""
        return shared_blob_store(self.settings, self.db)

    async def audit(self, admin: Admin | str, action: str, target: str, **details: Any) -> None:
        """One audit row; `admin` is the caller, or an actor's name for one not signed in."""
        actor = admin if isinstance(admin, str) else admin.actor

        def write() -> None:
            with self.db.session() as s:
                audit.record(s, actor, action, target, **details)

        await asyncio.to_thread(write)
        log.info("admin %s: %s %s", actor, action, target)

    def access_changed(self) -> None:
        self.gateway.auth.invalidate()

    def adapters_changed(self) -> None:
        """A version was published or removed: this process resolves names afresh at once."""
        self.access_changed()
        forget = getattr(self.gateway, "forget_adapter_refs", None)
        if forget is not None:
            forget()


def _clean_stale_uploads(folder: Path, max_age: float = 3600.0) -> None:
    """Staging left by uploads a crashed process never finished (never visible anyway)."""
    import time

    if not folder.is_dir():
        return
    cutoff = time.time() - max_age
    for p in folder.iterdir():
        try:
            if p.name.startswith("upload-") and p.lstat().st_mtime < cutoff:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


