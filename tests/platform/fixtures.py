"""Database fixtures shared by tests/platform and tests/e2e: every DB test runs on SQLite
and on PostgreSQL (127.0.0.1:5432, database `test`), each session in a fresh schema.

PostgreSQL tests skip when the server is unreachable, unless LORAPLEX_REQUIRE_POSTGRES=1
(CI sets it), where they fail instead.
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

PG_BASE = os.environ.get("LORAPLEX_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
BACKENDS = ("sqlite", "postgresql")


def _pg_admin():
    import psycopg

    return psycopg.connect(PG_BASE.replace("+psycopg", ""), autocommit=True, connect_timeout=3)


def _pg_available() -> str | None:
    try:
        with _pg_admin():
            return None
    except Exception as exc:  # noqa: BLE001 - any failure: not available
        return f"PostgreSQL unreachable at {PG_BASE}: {exc}"


def _require_pg() -> None:
    why = _pg_available()
    if why is None:
        return
    if os.environ.get("LORAPLEX_REQUIRE_POSTGRES") == "1":
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="session")
def pg_schema_url() -> Iterator:
    """A factory of fresh PostgreSQL schemas (URL with search_path set), all dropped at the end."""
    created: list[str] = []

    def make() -> str:
        _require_pg()
        schema = f"lpx_test_{uuid.uuid4().hex[:12]}"
        with _pg_admin() as conn:
            conn.execute(f'CREATE SCHEMA "{schema}"')
        created.append(schema)
        return f"{PG_BASE}?options=-csearch_path%3D{schema}"

    yield make
    if created:
        with _pg_admin() as conn:
            for schema in created:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def fresh_db_url(backend: str, tmp: Path, pg_schema_url) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp / f'db-{uuid.uuid4().hex[:8]}.sqlite'}"
    return pg_schema_url()


@pytest.fixture(params=BACKENDS)
def empty_db_url(request, tmp_path: Path, pg_schema_url) -> str:
    """An empty database (function scope), on each backend."""
    return fresh_db_url(request.param, tmp_path, pg_schema_url)


@pytest.fixture(params=BACKENDS)
def db(request, tmp_path: Path, pg_schema_url):
    """A migrated, empty `Database` (function scope), on each backend."""
    from loraplex.platform.db.database import Database, migrate

    url = fresh_db_url(request.param, tmp_path, pg_schema_url)
    migrate(url)
    database = Database(url)
    yield database
    database.dispose()


@pytest.fixture(scope="session")
def tiny_adapters(tmp_path_factory, tiny_llama_dir) -> dict[str, Path]:
    """Three real PEFT adapters (random non-zero weights) for the tiny Llama."""
    from loraplex.adapters.synth import make_random_peft_adapter

    root = tmp_path_factory.mktemp("tiny_adapters")
    return {f"ad{i}": make_random_peft_adapter(tiny_llama_dir, root / f"ad{i}", rank=r, seed=i, init_scale=0.3)
            for i, r in ((1, 4), (2, 8), (3, 16))}


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """Run the `loraplex` CLI in process: (exit code, stdout, stderr)."""
    from loraplex.platform.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out, err = capsys.readouterr()
    return e.value.code, out, err


@pytest.fixture
def cli(capsys, empty_db_url, tmp_path):
    def call(*argv):
        return run_cli(capsys, *argv, "--database-url", empty_db_url, "--data-dir", str(tmp_path / "data"))
    call.url = empty_db_url
    return call
