"""Admin sessions and the server secret, kept in the database so every replica agrees.

`server_secret(db)` is 32 random bytes generated once (the first replica to ask inserts
it; the others read it back). Admin session cookies are signed with a key derived from
it, never from the admin token: the token's hash (in a file or a backup) mints nothing.
A session is a row: signing out (on any replica) revokes it for all of them, and a
session whose admin token is no longer accepted ends with it.
"""
from __future__ import annotations

import datetime as dt
import secrets

from sqlalchemy import delete, update
from sqlalchemy.exc import IntegrityError

from loraplex.platform.db.admin_tables import AdminSession, ServerSecret
from loraplex.platform.db.base import utcnow
from loraplex.platform.db.database import Database

ADMIN_SECRET_NAME = "admin-session-key"


def server_secret(db: Database, name: str = ADMIN_SECRET_NAME) -> bytes:
    """The named random secret, generated on first use (race-safe across replicas)."""
    with db.session() as s:
        row = s.get(ServerSecret, name)
        if row is not None:
            return bytes.fromhex(row.value)
    try:
        with db.session() as s:
            s.add(ServerSecret(name=name, value=secrets.token_hex(32), created_at=utcnow()))
    except IntegrityError:
        pass  # another replica inserted it first: use theirs
    with db.session() as s:
        return bytes.fromhex(s.get(ServerSecret, name).value)


class SessionTable:
    """Rows of `admin_sessions`: created at sign-in, checked on every cookie request."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, token_id: str, expires: dt.datetime) -> str:
        sid = secrets.token_hex(16)
        with self.db.session() as s:
            # Sessions long expired are of no use to anyone: dropped as new ones come.
            s.execute(delete(AdminSession).where(AdminSession.expires_at < utcnow() - dt.timedelta(days=1)))
            s.add(AdminSession(id=sid, token_id=token_id, created_at=utcnow(), expires_at=expires))
        return sid

    def status(self, sid: str) -> tuple[str, str | None]:
        """("live" | "revoked" | "unknown", the token fingerprint it was signed in with)."""
        with self.db.session() as s:
            row = s.get(AdminSession, sid)
            if row is None:
                return "unknown", None
            return ("revoked" if row.revoked_at is not None else "live"), row.token_id

    def revoke(self, sid: str) -> None:
        with self.db.session() as s:
            s.execute(update(AdminSession).where(AdminSession.id == sid, AdminSession.revoked_at.is_(None))
                      .values(revoked_at=utcnow()))
