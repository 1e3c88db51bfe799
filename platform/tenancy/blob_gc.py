"""Collecting adapter blobs no registry row names any more.

Removing an adapter, or replacing its version, leaves the old version's blob in the shared
store (a folder, the database's `adapter_blobs` or an S3 bucket). A pass of `collect_blobs`
deletes the blobs that no `adapters` row names *and* that were seen unreferenced at least
`grace` seconds earlier: the first pass that finds a blob unreferenced only marks it (the
mark lives in the store, so any replica or `loraplex adapter gc` may run the next pass). The
grace covers what a pass cannot see: a worker still fetching a version that was current a
moment ago, and a publish whose registry row is not committed yet. A blob named again is
unmarked. A publish that re-used a blob a pass deleted meanwhile puts it back
(`ensure_published`), so a committed row never names a blob that stays missing.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select

from loraplex.adapters.blobs import BlobStore
from loraplex.platform.db.database import Database
from loraplex.platform.db.tables import Adapter

log = logging.getLogger(__name__)

DEFAULT_GRACE_SECONDS = 3600.0


@dataclass
class GcReport:
    deleted: list[str] = field(default_factory=list)  # digests removed from the store
    marked: list[str] = field(default_factory=list)  # newly seen unreferenced: deleted by a pass after the grace
    waiting: int = 0  # marked earlier, still inside the grace
    referenced: int = 0  # blobs a registry row names


def referenced_digests(db: Database) -> set[str]:
    with db.engine.connect() as conn:
        return set(conn.execute(select(Adapter.digest)).scalars())


def collect_blobs(db: Database, blobs: BlobStore, grace: float = DEFAULT_GRACE_SECONDS,
                  now: float | None = None) -> GcReport:
    """One pass (see the module docstring); run it off the event loop."""
    now = time.time() if now is None else now
    referenced = referenced_digests(db)
    stored = blobs.digests()
    marks = blobs.marks()
    report = GcReport(referenced=len(stored & referenced))
    for digest in marks.keys() - (stored - referenced):
        blobs.unmark(digest)  # named again, or gone already
    for digest in sorted(stored - referenced):
        since = marks.get(digest)
        if since is None:
            blobs.mark(digest, now)
            report.marked.append(digest)
        elif now - since < grace:
            report.waiting += 1
        elif digest not in referenced_digests(db):  # asked again just before: a row may have named it since
            blobs.delete(digest)
            blobs.unmark(digest)
            report.deleted.append(digest)
    if report.deleted or report.marked:
        log.info("adapter blob collection: %d deleted, %d newly unreferenced (deleted after %g s), %d waiting",
                 len(report.deleted), len(report.marked), grace, report.waiting)
    return report


def ensure_published(blobs: BlobStore, digest: str, files: Mapping[str, Path]) -> None:
    """After a registry row naming `digest` committed: put the blob back if a collection
    pass deleted it between the publish's put (which found it stored) and the commit."""
    if not blobs.exists(digest):
        log.warning("adapter blob %s was collected while being published again: stored again", digest)
        blobs.put(digest, files)
