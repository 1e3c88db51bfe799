"""`alembic upgrade head` on an empty database yields exactly the models' schema."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

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
