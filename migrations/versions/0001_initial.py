"""tenants, api keys, adapters, adapter grants

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("default_lane", sa.String(length=16), nullable=False),
        sa.Column("allowed_lanes", sa.String(length=64), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "adapters",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("digest", sa.String(length=80), nullable=False),
        sa.Column("owner_tenant_id", sa.Integer(), nullable=True),
        sa.Column("public", sa.Boolean(), nullable=False),
        _ts("created_at"),
        _ts("updated_at"),
        sa.ForeignKeyConstraint(["owner_tenant_id"], ["tenants.id"],
                                name=op.f("fk_adapters_owner_tenant_id_tenants"), ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapters")),
        sa.UniqueConstraint("name", name=op.f("uq_adapters_name")),
    )
    op.create_index(op.f("ix_adapters_owner_tenant_id"), "adapters", ["owner_tenant_id"])
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=True),
        _ts("created_at"),
        _ts("expires_at", nullable=True),
        _ts("revoked_at", nullable=True),
        _ts("last_used_at", nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name=op.f("fk_api_keys_tenant_id_tenants"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("prefix", name=op.f("uq_api_keys_prefix")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])
    op.create_table(
        "adapter_grants",
        sa.Column("adapter_id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        _ts("created_at"),
        sa.ForeignKeyConstraint(["adapter_id"], ["adapters.id"],
                                name=op.f("fk_adapter_grants_adapter_id_adapters"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name=op.f("fk_adapter_grants_tenant_id_tenants"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("adapter_id", "tenant_id", name=op.f("pk_adapter_grants")),
    )
    op.create_index(op.f("ix_adapter_grants_tenant_id"), "adapter_grants", ["tenant_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_adapter_grants_tenant_id"), table_name="adapter_grants")
    op.drop_table("adapter_grants")
    op.drop_index(op.f("ix_api_keys_tenant_id"), table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_index(op.f("ix_adapters_owner_tenant_id"), table_name="adapters")
    op.drop_table("adapters")
    op.drop_table("tenants")
