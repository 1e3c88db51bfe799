"""The Alembic scripts ship beside the platform package (loraplex.migrations when installed)."""
from __future__ import annotations

from loraplex.platform.db.database import migrations_dir


def test_migrations_ship_beside_the_platform_package():
    assert (migrations_dir() / "env.py").is_file()
    assert (migrations_dir() / "script.py.mako").is_file()
    assert any(migrations_dir().joinpath("versions").glob("*.py"))
