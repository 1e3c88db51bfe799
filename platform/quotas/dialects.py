"""The quota store for a database's SQL dialect, chosen once at start."""
from __future__ import annotations

from sqlalchemy import Engine

from loraplex.platform.quotas.postgres import PostgresQuotaStore
from loraplex.platform.quotas.sqlite import SqliteQuotaStore
from loraplex.platform.quotas.store import QuotaStore


def open_quota_store(engine: Engine, holder: str, lease_ttl: float = 60.0, threads: int = 4) -> QuotaStore:
    """The store for `engine`'s dialect."""
    cls = PostgresQuotaStore if engine.dialect.name == "postgresql" else SqliteQuotaStore
    return cls(engine, holder, lease_ttl, threads)
