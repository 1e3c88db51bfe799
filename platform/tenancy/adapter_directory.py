"""Adapter names -> the version (content digest) they run now, from the registry.

Workers know adapters only by digest, and `serve` replicas sharing an adapter store each
keep their own disk copy: the name a tenant uses is resolved here, in the shared
database, so every replica runs the version the registry published.
"""
from __future__ import annotations

from sqlalchemy import select

from loraplex.engine.errors import UnknownAdapterError
from loraplex.engine.request import AdapterRef

from loraplex.platform.db.database import Database
from loraplex.platform.db.tables import Adapter


class AdapterDirectory:
    def __init__(self, db: Database) -> None:
        self.db = db

    def resolve(self, name: str) -> AdapterRef:
        """The adapter's current version; UnknownAdapterError when the registry lacks it."""
        with self.db.engine.connect() as conn:
            digest = conn.execute(select(Adapter.digest).where(Adapter.name == name)).scalar_one_or_none()
        if digest is None:
            raise UnknownAdapterError(f"no adapter named {name!r}")
        return AdapterRef(name, digest)

    def close(self) -> None:
        self.db.dispose()
