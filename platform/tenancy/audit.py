"""The admin audit log: one row per change made through the admin API (who, what, when).

`who` is the admin credential that made the change ("token:<id>" for a Bearer token,
"session:<id>" for a browser session signed in with that token), `action` a dotted verb
("tenant.create", "key.revoke", "adapter.upload", ...), `target` what it changed
("tenant:acme", "key:lpx_ab12", "adapter:sql-helper") and `details` a small JSON object
(never secrets).
"""
from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.platform.db.base import utcnow
from loraplex.platform.db.tables import AuditEntry


def record(s: Session, actor: str, action: str, target: str = "", **details: Any) -> AuditEntry:
    """Add an audit row in the caller's transaction: it commits (or rolls back) with the change."""
    entry = AuditEntry(actor=actor, action=action, target=target, details=details, created_at=utcnow())
    s.add(entry)
    return entry


def entries(s: Session, *, limit: int = 100, before_id: int | None = None,
            action: str | None = None, target: str | None = None) -> list[AuditEntry]:
    """Newest first; `before_id` pages back."""
    q = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    if before_id is not None:
        q = q.where(AuditEntry.id < before_id)
    if action:
        q = q.where(AuditEntry.action == action)
    if target:
        q = q.where(AuditEntry.target == target)
    return list(s.scalars(q))
