"""SQLAlchemy 2.0 models of the platform's tables. Alembic migrations must match them."""
from __future__ import annotations

import datetime as dt

from sqlalchemy import (
    Boolean,
    DateTime,
    ForeignKey,
    Integer,
    MetaData,
    String,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

LANES = ("interactive", "standard", "batch")  # highest priority first, as engine Lane 0..2

# Stable constraint names, so migrations and autogenerate agree on every backend.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite hands back naive ones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime; use timezone-aware UTC")
        return value.astimezone(dt.timezone.utc) if value is not None else None

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=dt.timezone.utc)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


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


# Tables defined in other modules register on Base.metadata here, so create_all,
# Alembic and the migration tests see every table.
from . import audit as _audit  # noqa: E402,F401
from . import usage_models as _usage_models  # noqa: E402,F401  (quotas, metering: issue 5)
