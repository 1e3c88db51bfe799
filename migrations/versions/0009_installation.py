"""installation: the database's identity, which a gateway's usage journal carries so that
it is replayed into this database only

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""
from __future__ import annotations

import datetime as dt
import uuid

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "installation",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_installation")),
    )
    op.bulk_insert(table, [{"id": uuid.uuid4().hex, "created_at": dt.datetime.now(dt.timezone.utc)}])


def downgrade() -> None:
    op.drop_table("installation")
