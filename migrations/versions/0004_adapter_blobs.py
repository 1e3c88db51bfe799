"""adapter_blobs: adapter files in chunked rows, keyed by content digest

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "adapter_blobs",
        sa.Column("digest", sa.String(length=71), nullable=False),
        sa.Column("file_name", sa.String(length=64), nullable=False),
        sa.Column("chunk_index", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("digest", "file_name", "chunk_index", name=op.f("pk_adapter_blobs")),
    )


def downgrade() -> None:
    op.drop_table("adapter_blobs")
