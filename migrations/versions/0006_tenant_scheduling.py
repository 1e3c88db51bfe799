"""tenant scheduling: per-tenant weight and request timeout; usage events' correlation id

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("weight", sa.Float(), server_default=sa.text("1.0"), nullable=False))
        batch.add_column(sa.Column("request_timeout", sa.Float(), nullable=True))
    with op.batch_alter_table("usage_events") as batch:
        batch.add_column(sa.Column("correlation_id", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_events") as batch:
        batch.drop_column("correlation_id")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("request_timeout")
        batch.drop_column("weight")
