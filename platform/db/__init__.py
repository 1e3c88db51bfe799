"""The platform's database: the declarative base, the tables, sessions and migrations.

Importing the package registers every table on `Base.metadata`, so `create_all`, Alembic
and the migration tests see them all.
"""
from loraplex.platform.db import tables, usage_tables  # noqa: F401
from loraplex.platform.db.database import migrate

__all__ = ["migrate"]
