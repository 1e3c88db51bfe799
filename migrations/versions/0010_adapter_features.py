"""adapter features: the current version's kind (DoRA, lora_bias, trainable tokens,
saved modules, ...); null in rows registered before, which read as unknown

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("features", sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    # In place (ALTER TABLE ... DROP COLUMN, SQLite 3.35+): no copy of the table's rows,
    # so the adapters' grants (ON DELETE CASCADE) stay.
    with op.batch_alter_table("adapters", recreate="never") as batch:
        batch.drop_column("features")
