"""SQLAlchemy 2.0 engine and session factory (SQLite or PostgreSQL via psycopg 3), and migrations."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from loraplex.platform.errors import ConfigError

# Seconds to open a PostgreSQL connection: an unreachable server fails a request (503)
# instead of holding it, and a pool thread, for the OS's TCP timeout.
PG_CONNECT_TIMEOUT = 5


def normalize_url(url: str) -> str:
    """postgres:// and postgresql:// use psycopg 3 (the driver loraplex ships with)."""
    u = make_url(url)
    if u.drivername in ("postgres", "postgresql"):
        u = u.set(drivername="postgresql+psycopg")
    return u.render_as_string(hide_password=False)


def make_db_engine(url: str, *, pre_ping: bool = True, pool_size: int = 5, max_overflow: int = 5,
                   sqlite_synchronous: str | None = None) -> Engine:
    """`pre_ping=False` saves a round trip per checkout for hot paths that retry on
    connection errors themselves; `sqlite_synchronous` ("NORMAL") trades durability on
    power loss (not on a crash) for a commit without fsync in WAL mode."""
    try:
        u = make_url(normalize_url(url))
    except Exception as exc:  # sqlalchemy raises ArgumentError and friends
        raise ConfigError(f"invalid database URL {url!r}: {exc}") from None
    if u.get_backend_name() not in ("sqlite", "postgresql"):
        raise ConfigError(f"unsupported database {u.get_backend_name()!r}: use sqlite:/// or postgresql://")
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:":
            Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(u, connect_args={"timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        if sqlite_synchronous:
            event.listen(engine, "connect", lambda c, _r: c.execute(f"PRAGMA synchronous={sqlite_synchronous}"))
        return engine
    return create_engine(u, pool_pre_ping=pre_ping, pool_size=pool_size, max_overflow=max_overflow,
                         connect_args={"connect_timeout": PG_CONNECT_TIMEOUT})


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA foreign_keys=ON")
    # WAL lets the CLI write while a server reads the same file.
    cur.execute("PRAGMA journal_mode=WAL")
    cur.close()


class Database:
    """An engine plus a session factory; `with db.session() as s:` commits on success."""

    def __init__(self, url: str) -> None:
        self.url = normalize_url(url)
        self.engine = make_db_engine(self.url)
        self._factory = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._factory() as s, s.begin():
            yield s

    @staticmethod
    def display_url(url: str) -> str:
        return make_url(normalize_url(url)).render_as_string(hide_password=True)

    def ping(self) -> None:
        with self.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    def dispose(self) -> None:
        self.engine.dispose()


def migrations_dir() -> Path:
    """The Alembic scripts: <repo>/migrations in a checkout, loraplex/migrations when installed.

    Both sit next to this package's folder (package-dir maps loraplex.migrations there).
    """
    path = Path(__file__).resolve().parents[2] / "migrations"
    if not (path / "env.py").is_file():
        raise ConfigError(f"the Alembic migrations are missing (looked in {path})")
    return path


def alembic_config(url: str):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    # ConfigParser interpolation: a literal % in a URL (escaped passwords) must be doubled.
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return cfg


# The PostgreSQL advisory lock migrations take turns under (any fixed 64-bit key).
MIGRATION_LOCK_KEY = 0x6C6F7261706C6578  # "loraplex"


def migrate(url: str, revision: str = "head") -> None:
    """`alembic upgrade head` on `url` (creates the schema in an empty database).

    On PostgreSQL the processes that migrate at once (a pool's `serve` replicas starting
    beside the chart's migration Job) take turns under an advisory lock: the first
    upgrades, the others then find the schema current, instead of racing to create the
    same tables and failing."""
    from alembic import command

    cfg = alembic_config(url)
    if make_url(normalize_url(url)).get_backend_name() != "postgresql":
        command.upgrade(cfg, revision)
        return
    engine = make_db_engine(url, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f"SELECT pg_advisory_lock({MIGRATION_LOCK_KEY})")
            conn.commit()  # a session lock: it outlives this transaction
            try:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, revision)
                conn.commit()
            finally:
                conn.rollback()
                conn.exec_driver_sql(f"SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})")
                conn.commit()
    finally:
        engine.dispose()


def database_id(engine: Engine) -> str:
    """This database's identity (made by the migration that created its `installation`
    table): the same through any URL, any replica, and a restore from its backup."""
    with engine.connect() as conn:
        row = conn.exec_driver_sql("SELECT id FROM installation").first()
    if row is None:
        raise ConfigError("the database has no identity row (table installation); run `loraplex migrate`")
    return row[0]
