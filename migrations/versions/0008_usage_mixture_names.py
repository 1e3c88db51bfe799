"""usage adapter names long enough for adapter mixtures ("a*0.7+b*0.3", up to 4 components)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("usage_adapters") as batch:
        batch.alter_column("name", existing_type=sa.String(length=64), type_=sa.String(length=400),
                           existing_nullable=False)


def downgrade() -> None:
    # PostgreSQL refuses while a mixture's usage row holds a longer name: usage is never dropped silently.
    with op.batch_alter_table("usage_adapters") as batch:
        batch.alter_column("name", existing_type=sa.String(length=400), type_=sa.String(length=64),
                           existing_nullable=False)
