"""adapter metadata: the current version's rank, alpha, target modules and size

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("rank", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("alpha", sa.Float(), nullable=True))
        batch.add_column(sa.Column("target_modules", sa.JSON(none_as_null=True), nullable=True))
        batch.add_column(sa.Column("size_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    # In place (ALTER TABLE ... DROP COLUMN, SQLite 3.35+): no copy of the table's rows.
    with op.batch_alter_table("adapters", recreate="never") as batch:
        batch.drop_column("size_bytes")
        batch.drop_column("target_modules")
        batch.drop_column("alpha")
        batch.drop_column("rank")
