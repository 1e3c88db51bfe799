"""Alembic environment for loraplex's platform tables.

The database URL, first found wins: a connection handed in by code
(`config.attributes["connection"]`), `sqlalchemy.url` set by code (`loraplex` CLI),
`alembic -x database_url=...`, $LORAPLEX_DATABASE_URL, else the default SQLite file in
the data dir ($LORAPLEX_DATA_DIR or ~/.local/share/loraplex).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from logging.config import fileConfig

from alembic import context
from sqlalchemy.engine import Connection

from loraplex.platform.db.database import make_db_engine, normalize_url
import loraplex.platform.db  # noqa: F401  (registers every table on Base.metadata)
from loraplex.platform.db.base import Base
from loraplex.platform.settings import Settings

config = context.config
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or context.get_x_argument(as_dictionary=True).get("database_url")
    return normalize_url(url or Settings().db_url)


def _configure(**kwargs) -> None:
    context.configure(target_metadata=target_metadata, compare_type=True, render_as_batch=True, **kwargs)


def run_offline() -> None:
    _configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


@contextlib.contextmanager
def _sqlite_foreign_keys_off(connection: Connection) -> Iterator[None]:
    """SQLite alters a table by copying it and dropping the original, and with foreign
    keys on that drop fires ON DELETE CASCADE: every api key of a rebuilt `tenants`, every
    grant of a rebuilt `adapters` would go. So they are off while migrations run (the
    pragma is a no-op inside a transaction, hence before it begins), and the result is
    checked before they are back on."""
    if connection.dialect.name != "sqlite":
        yield
        return
    connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
    try:
        yield
        broken = connection.exec_driver_sql("PRAGMA foreign_key_check").all()
        if broken:
            raise RuntimeError(f"the migration left rows whose foreign keys match nothing: {broken[:5]}")
    finally:
        connection.exec_driver_sql("PRAGMA foreign_keys=ON")


def _run(connection: Connection) -> None:
    _configure(connection=connection)
    with _sqlite_foreign_keys_off(connection), context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    conn = config.attributes.get("connection")
    if conn is not None:
        _run(conn)
        return
    engine = make_db_engine(_url())
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
