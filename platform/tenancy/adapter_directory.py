"""Adapter names -> the version (content digest) they run now, from the registry.

Workers know adapters only by digest, and `serve` replicas sharing an adapter store each
keep their own disk copy: the name a tenant uses is resolved here, in the shared
database, so every replica runs the version the registry published.
"""
from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select

from loraplex.engine.errors import UnknownAdapterError
from loraplex.engine.request import AdapterRef

from loraplex.platform.db.database import Database
from loraplex.platform.db.tables import Adapter

# A name lookup is one indexed row: longer means a lock or an overloaded server, and the
# request is better refused (503, retry) than left holding a connection.
LOOKUP_STATEMENT_TIMEOUT_MS = 2000


@dataclass(frozen=True)
class RegistryVersion:
    """A name's current version as the registry recorded it; `rank` is None for a row
    published before the registry kept ranks (loading then enforces max_lora_rank)."""

    name: str
    digest: str
    rank: int | None = None


class AdapterDirectory:
    def __init__(self, db: Database) -> None:
        self.db = db

    def version(self, name: str) -> RegistryVersion:
        """The adapter's current version; UnknownAdapterError when the registry lacks it."""
        with self.db.engine.connect() as conn:
            if conn.dialect.name == "postgresql":  # for this transaction only
                conn.exec_driver_sql(f"SET LOCAL statement_timeout = {LOOKUP_STATEMENT_TIMEOUT_MS}")
            row = conn.execute(select(Adapter.digest, Adapter.rank).where(Adapter.name == name)).one_or_none()
        if row is None:
            raise UnknownAdapterError(f"no adapter named {name!r}")
        return RegistryVersion(name, row.digest, row.rank)

    def resolve(self, name: str) -> AdapterRef:
        """The adapter's current version as the engine names it (see `version`)."""
        v = self.version(name)
        return AdapterRef(v.name, v.digest)

    def close(self) -> None:
        self.db.dispose()
