"""quotas, quota counters and leases, usage events, hourly rollups

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "quotas",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("scope", sa.String(length=32), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("key_id", sa.Integer(), nullable=True),
        sa.Column("rpm", sa.Integer(), nullable=True),
        sa.Column("tpm", sa.BigInteger(), nullable=True),
        sa.Column("max_concurrency", sa.Integer(), nullable=True),
        sa.Column("token_budget", sa.BigInteger(), nullable=True),
        sa.Column("budget_period", sa.String(length=8), nullable=True),
        _ts("updated_at"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_quotas_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["key_id"], ["api_keys.id"], name=op.f("fk_quotas_key_id_api_keys"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_quotas")),
        sa.UniqueConstraint("scope", name=op.f("uq_quotas_scope")),
    )
    op.create_index(op.f("ix_quotas_tenant_id"), "quotas", ["tenant_id"])
    op.create_table(
        "quota_counters",
        sa.Column("scope", sa.String(length=32), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("window_start", sa.BigInteger(), nullable=False),
        sa.Column("used", sa.BigInteger(), nullable=False),
        sa.Column("lim", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("scope", "kind", "window_start", name=op.f("pk_quota_counters")),
    )
    op.create_table(
        "quota_leases",
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("holder", sa.String(length=32), nullable=False),
        sa.Column("state", sa.String(length=8), nullable=False),
        sa.Column("expires_at", sa.BigInteger(), nullable=False),
        sa.Column("charges", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_quota_leases")),
    )
    op.create_index(op.f("ix_quota_leases_holder"), "quota_leases", ["holder"])
    op.create_index(op.f("ix_quota_leases_expires_at"), "quota_leases", ["expires_at"])
    op.create_table(
        "usage_adapters",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("digest", sa.String(length=80), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_adapters")),
        sa.UniqueConstraint("name", "digest", name="uq_usage_adapters_name_digest"),
    )
    op.create_table(
        "usage_events",
        sa.Column("id", _BIG_ID, autoincrement=True, nullable=False),
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("key_id", sa.Integer(), nullable=True),
        sa.Column("adapter_id", sa.Integer(), nullable=False),
        sa.Column("lane", sa.SmallInteger(), nullable=False),
        sa.Column("status", sa.String(length=8), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        _ts("received_at"),
        _ts("first_token_at", nullable=True),
        _ts("finished_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_events")),
        sa.UniqueConstraint("request_id", name=op.f("uq_usage_events_request_id")),
    )
    op.create_index("ix_usage_events_tenant_finished", "usage_events", ["tenant_id", "finished_at"])
    op.create_index("ix_usage_events_finished", "usage_events", ["finished_at"])
    op.create_table(
        "usage_hourly",
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        _ts("hour"),
        sa.Column("adapter_id", sa.Integer(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("aborted", sa.BigInteger(), nullable=False),
        sa.Column("errors", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "hour", "adapter_id", name=op.f("pk_usage_hourly")),
    )
    op.create_index("ix_usage_hourly_hour", "usage_hourly", ["hour"])


def downgrade() -> None:
    op.drop_index("ix_usage_hourly_hour", table_name="usage_hourly")
    op.drop_table("usage_hourly")
    op.drop_index("ix_usage_events_finished", table_name="usage_events")
    op.drop_index("ix_usage_events_tenant_finished", table_name="usage_events")
    op.drop_table("usage_events")
    op.drop_table("usage_adapters")
    op.drop_index(op.f("ix_quota_leases_expires_at"), table_name="quota_leases")
    op.drop_index(op.f("ix_quota_leases_holder"), table_name="quota_leases")
    op.drop_table("quota_leases")
    op.drop_table("quota_counters")
    op.drop_index(op.f("ix_quotas_tenant_id"), table_name="quotas")
    op.drop_table("quotas")
