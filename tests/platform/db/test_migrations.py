"""`alembic upgrade head` on an empty database yields exactly the models' schema."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from loraplex.platform.db.database import make_db_engine, migrate
from loraplex.platform.db.base import Base

REPO = Path(__file__).resolve().parents[3]


def _diffs(url: str) -> list:
    engine = make_db_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = make_db_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_head_matches_models(empty_db_url):
    assert _tables(empty_db_url) == set()
    migrate(empty_db_url)
    assert _diffs(empty_db_url) == []
    assert _tables(empty_db_url) == set(Base.metadata.tables) | {"alembic_version"}
    migrate(empty_db_url)  # idempotent
    assert _diffs(empty_db_url) == []


def test_processes_migrating_one_postgresql_at_once_take_turns(pg_schema_url):
    """A pool's `serve` replicas and the chart's migration Job start together on an empty
    database: every one of them succeeds and the schema is the models'."""
    url = pg_schema_url()
    code = "import sys; from loraplex.platform.db import migrate; migrate(sys.argv[1])"
    procs = [subprocess.Popen([sys.executable, "-c", code, url], stderr=subprocess.PIPE, env=os.environ.copy())
             for _ in range(3)]
    errors = [p.communicate(timeout=300)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    assert _diffs(url) == []


def test_downgrade_base_removes_everything(empty_db_url):
    from alembic import command

    from loraplex.platform.db.database import alembic_config

    migrate(empty_db_url)
    command.downgrade(alembic_config(empty_db_url), "base")
    assert _tables(empty_db_url) <= {"alembic_version"}


def test_plain_alembic_command_in_repo_root(empty_db_url):
    """`alembic upgrade head` with the repo's alembic.ini (URL from the environment)."""
    env = {**os.environ, "LORAPLEX_DATABASE_URL": empty_db_url}
    proc = subprocess.run([sys.executable, "-m", "alembic", "upgrade", "head"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _diffs(empty_db_url) == []


def _columns(url: str, table: str) -> set[str]:
    engine = make_db_engine(url)
    try:
        return {c["name"] for c in inspect(engine).get_columns(table)}
    finally:
        engine.dispose()


def test_0007_adapter_metadata_up_and_down_keeps_existing_rows(empty_db_url):
    """Adapters registered before 0007 keep their rows with no metadata (listings fall back
    to the local store), and a downgrade drops only the new columns: the adapter's grants
    (ON DELETE CASCADE) survive it, which a copy-and-drop of the table would not."""
    from alembic import command

    from loraplex.platform.db.database import alembic_config

    metadata = {"rank", "alpha", "target_modules", "size_bytes"}
    migrate(empty_db_url, "0006")
    engine = make_db_engine(empty_db_url)
    try:
        with engine.begin() as conn:
            t = {"t": "2026-12-01 00:00:00+00:00"}
            conn.execute(text("INSERT INTO tenants (id, name, default_lane, allowed_lanes, enabled, created_at) "
                              "VALUES (1, 'acme', 'standard', 'standard', true, :t)"), t)
            conn.execute(text("INSERT INTO adapters (id, name, digest, public, owner_tenant_id, created_at, "
                              "updated_at) VALUES (1, 'old', 'sha256:00', false, 1, :t, :t)"), t)
            conn.execute(text("INSERT INTO adapter_grants (adapter_id, tenant_id, created_at) VALUES (1, 1, :t)"), t)
        migrate(empty_db_url, "0007")
        assert metadata <= _columns(empty_db_url, "adapters")
        with engine.connect() as conn:
            row = conn.execute(text("SELECT digest, rank, alpha, target_modules, size_bytes FROM adapters")).one()
        assert tuple(row) == ("sha256:00", None, None, None, None)

        command.downgrade(alembic_config(empty_db_url), "0006")
        assert not metadata & _columns(empty_db_url, "adapters")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT name, digest, owner_tenant_id FROM adapters")).all() == [
                ("old", "sha256:00", 1)]
            assert conn.execute(text("SELECT adapter_id, tenant_id FROM adapter_grants")).all() == [(1, 1)]
        migrate(empty_db_url)
        assert _diffs(empty_db_url) == []
    finally:
        engine.dispose()


def test_0010_adapter_features_up_and_down_keeps_existing_rows(empty_db_url):
    """Adapters registered before 0010 keep their rows with an unknown kind (null, not []),
    and a downgrade drops only that column, in place: the grants survive it."""
    from alembic import command

    from loraplex.platform.db.database import alembic_config

    migrate(empty_db_url, "0009")
    engine = make_db_engine(empty_db_url)
    try:
        with engine.begin() as conn:
            t = {"t": "2026-12-03 00:00:00+00:00"}
            conn.execute(text("INSERT INTO tenants (id, name, default_lane, allowed_lanes, enabled, created_at) "
                              "VALUES (1, 'acme', 'standard', 'standard', true, :t)"), t)
            conn.execute(text("INSERT INTO adapters (id, name, digest, public, owner_tenant_id, created_at, "
                              "updated_at, rank) VALUES (1, 'old', 'sha256:00', false, 1, :t, :t, 4)"), t)
            conn.execute(text("INSERT INTO adapter_grants (adapter_id, tenant_id, created_at) VALUES (1, 1, :t)"), t)
        migrate(empty_db_url, "0010")
        with engine.connect() as conn:
            assert tuple(conn.execute(text("SELECT digest, rank, features FROM adapters")).one()) == (
                "sha256:00", 4, None)

        command.downgrade(alembic_config(empty_db_url), "0009")
        assert "features" not in _columns(empty_db_url, "adapters")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT name, rank, owner_tenant_id FROM adapters")).all() == [("old", 4, 1)]
            assert conn.execute(text("SELECT adapter_id, tenant_id FROM adapter_grants")).all() == [(1, 1)]
        migrate(empty_db_url)
        assert _diffs(empty_db_url) == []
    finally:
        engine.dispose()


def _count(url: str, table: str) -> int:
    engine = make_db_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
    finally:
        engine.dispose()


def test_every_downgrade_keeps_the_rows_that_reference_altered_tables(empty_db_url):
    """Each revision down to the first, with a tenant, its key and an adapter granted to
    it: no downgrade loses the key or the grant (on SQLite a table rebuild drops the
    original table, which would cascade to them if foreign keys were on)."""
    from alembic import command
    from alembic.script import ScriptDirectory

    from loraplex.platform.db.database import Database, alembic_config
    from loraplex.platform.tenancy.tenants import create_key, create_tenant

    migrate(empty_db_url)
    db = Database(empty_db_url)
    try:
        create_tenant(db, "acme", "standard")
        create_key(db, "acme")
    finally:
        db.dispose()
    engine = make_db_engine(empty_db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO adapters (id, name, digest, public, owner_tenant_id, created_at, "
                              "updated_at) SELECT 1, 'a', 'sha256:00', false, id, created_at, created_at "
                              "FROM tenants WHERE name = 'acme'"))
            conn.execute(text("INSERT INTO adapter_grants (adapter_id, tenant_id, created_at) "
                              "SELECT 1, id, created_at FROM tenants WHERE name = 'acme'"))
    finally:
        engine.dispose()
    cfg = alembic_config(empty_db_url)
    revisions = [r.revision for r in ScriptDirectory.from_config(cfg).walk_revisions()]  # head first
    for down_to in revisions[1:]:
        command.downgrade(cfg, down_to)
        counts = {t: _count(empty_db_url, t) for t in ("tenants", "api_keys", "adapters", "adapter_grants")}
        assert counts == dict.fromkeys(counts, 1), (down_to, counts)
    migrate(empty_db_url)
    assert _diffs(empty_db_url) == []
