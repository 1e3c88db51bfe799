"""SQLAlchemy 2.0 models of the platform's tenancy tables (tenants, keys, adapters, the
admin audit log) and of the database's identity. Alembic migrations must match them."""
from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Float, ForeignKey, Integer, String, text
from sqlalchemy.orm import Mapped, mapped_column, relationship

from loraplex.platform.db.base import Base, UTCDateTime, utcnow


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    # The lane this tenant's requests get; a request may ask for a lower one only.
    default_lane: Mapped[str] = mapped_column(String(16), default="standard")
    # Comma-separated lanes the tenant may ask for (all at or below default_lane).
    allowed_lanes: Mapped[str] = mapped_column(String(64), default="standard,batch")
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    # Its share of the engine inside a lane, relative to other tenants (tenant-fair
    # scheduling), and of the engine's waiting queue.
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default=text("1.0"))
    # Seconds a request may run before the engine ends it; None: the server's default.
    request_timeout: Mapped[float | None] = mapped_column(Float, default=None)

    keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant", cascade="all, delete-orphan")

    @property
    def lanes(self) -> tuple[str, ...]:
        return tuple(x for x in self.allowed_lanes.split(",") if x)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    # The short visible part of the key ("lpx_<prefix>_..."): how operators name a key.
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    # sha256 hex of the whole key; the key itself is shown once and never stored.
    secret_hash: Mapped[str] = mapped_column(String(64))
    name: Mapped[str | None] = mapped_column(String(128), default=None)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, default=None)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, default=None)
    last_used_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, default=None)

    tenant: Mapped[Tenant] = relationship(back_populates="keys")


class Adapter(Base):
    __tablename__ = "adapters"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    # The content digest of the current version ("sha256:...") in the adapter store.
    digest: Mapped[str] = mapped_column(String(80))
    owner_tenant_id: Mapped[int | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="SET NULL"), index=True, default=None)
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    # The current version's shape, so every replica can describe a version it has never
    # stored on its own disk; None in rows written before these columns existed.
    rank: Mapped[int | None] = mapped_column(Integer, default=None)
    alpha: Mapped[float | None] = mapped_column(Float, default=None)
    target_modules: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True), default=None)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    # The current version's kind (`loraplex.adapters.features`): [] plain LoRA; None in rows
    # written before this column existed (unknown).
    features: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True), default=None)

    owner: Mapped[Tenant | None] = relationship()
    grants: Mapped[list[AdapterGrant]] = relationship(back_populates="adapter", cascade="all, delete-orphan")


class AdapterGrant(Base):
    __tablename__ = "adapter_grants"

    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapters.id", ondelete="CASCADE"), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True,
                                           index=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)

    adapter: Mapped[Adapter] = relationship(back_populates="grants")
    tenant: Mapped[Tenant] = relationship()


class AuditEntry(Base):
    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64), index=True)
    target: Mapped[str] = mapped_column(String(200), default="")
    details: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


# Adapter blobs for a fleet's shared store (loraplex.adapters.blobs_sql), in this metadata
# so migrations and tables are checked together.
from loraplex.adapters.blobs_sql import adapter_blobs_table  # noqa: E402

adapter_blobs = adapter_blobs_table(Base.metadata)


class Installation(Base):
    """One row: this database's identity, made when it was created. Whatever is kept
    outside the database on its behalf (a gateway's usage journal) carries it, so that it
    is only ever replayed into this database."""

    __tablename__ = "installation"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
