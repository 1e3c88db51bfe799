"""Tables of quotas (limits, counters, leases) and metering (usage events, hourly rollups).

Registered on `db.base.Base.metadata` (the `db` package imports this module), created
by migration 0003.

- `quotas`: the limits of a tenant (scope "t:<tenant id>") or of one API key
  ("k:<key id>"); NULL means no limit.
- `quota_counters`: one row per (scope, kind, window start): requests and tokens used in
  the current minute (`rpm`, `tpm`), tokens used in the budget period (`budget`, window =
  the period's start), and requests in flight (`conc`, window 0). Every replica changes
  them with atomic conditional upserts, so replicas sharing a database enforce one limit.
- `quota_leases`: one row per admitted request that holds something to give back
  (a concurrency slot, a token reservation). The holder renews its leases; a lease whose
  holder died expires and any replica's reaper gives its reservation back.
- `usage_events`: one small row per request, unique by request id (the id the client
  saw), so a retried batch never writes an event twice.
- `usage_hourly`: per tenant, hour and adapter version, maintained in the same
  transaction as the events it sums (only rows actually inserted are added).
- `usage_adapters`: the (name, digest) of each adapter version seen, so events and rollups
  store a small integer (0: the base model).
"""
from __future__ import annotations

import datetime as dt

from sqlalchemy import (
    JSON,
    BigInteger,
    ForeignKey,
    Index,
    Integer,
    SmallInteger,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from loraplex.platform.db.base import Base, UTCDateTime, utcnow

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets a BIGINT identity.
BigId = BigInteger().with_variant(Integer(), "sqlite")

BASE_ADAPTER_ID = 0  # usage_events.adapter_id of base-model requests


class Quota(Base):
    __tablename__ = "quotas"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # "t:<tenant id>" or "k:<key id>": the subject of the counters too.
    scope: Mapped[str] = mapped_column(String(32), unique=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), default=None)
    rpm: Mapped[int | None] = mapped_column(Integer, default=None)
    tpm: Mapped[int | None] = mapped_column(BigInteger, default=None)
    max_concurrency: Mapped[int | None] = mapped_column(Integer, default=None)
    token_budget: Mapped[int | None] = mapped_column(BigInteger, default=None)
    budget_period: Mapped[str | None] = mapped_column(String(8), default=None)  # day | month
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


class QuotaCounter(Base):
    __tablename__ = "quota_counters"

    scope: Mapped[str] = mapped_column(String(32), primary_key=True)
    kind: Mapped[str] = mapped_column(String(8), primary_key=True)  # rpm | tpm | budget | conc
    window_start: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # unix seconds; conc: 0
    used: Mapped[int] = mapped_column(BigInteger, default=0)
    lim: Mapped[int] = mapped_column(BigInteger, default=0)  # the limit when last admitted against


class QuotaLease(Base):
    __tablename__ = "quota_leases"

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(32), index=True)  # the gateway process holding it
    state: Mapped[str] = mapped_column(String(8), default="live")  # live | reaped
    expires_at: Mapped[int] = mapped_column(BigInteger, index=True)  # unix seconds
    # [[scope, kind, window_start, amount], ...]: what admission took.
    charges: Mapped[list] = mapped_column(JSON)


class UsageAdapter(Base):
    __tablename__ = "usage_adapters"
    __table_args__ = (UniqueConstraint("name", "digest", name="uq_usage_adapters_name_digest"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(400))  # an adapter's, or a mixture's (engine/mixtures.py)
    digest: Mapped[str] = mapped_column(String(80))


class UsageEvent(Base):
    __tablename__ = "usage_events"
    __table_args__ = (
        Index("ix_usage_events_tenant_finished", "tenant_id", "finished_at"),
        Index("ix_usage_events_finished", "finished_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(64), unique=True)  # the id the client saw
    # The x-request-id of the HTTP request (sent by the client or made by the gateway):
    # what logs, traces and the worker hop carry. Not unique: clients may reuse theirs.
    correlation_id: Mapped[str | None] = mapped_column(String(128), default=None)
    tenant_id: Mapped[int] = mapped_column(Integer)  # no FK: billing history outlives a tenant
    key_id: Mapped[int | None] = mapped_column(Integer, default=None)
    adapter_id: Mapped[int] = mapped_column(Integer, default=BASE_ADAPTER_ID)
    lane: Mapped[int] = mapped_column(SmallInteger)  # 0 interactive, 1 standard, 2 batch
    status: Mapped[str] = mapped_column(String(8))  # stop | length | aborted | error | timeout
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    received_at: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    first_token_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, default=None)
    finished_at: Mapped[dt.datetime] = mapped_column(UTCDateTime)


class UsageHourly(Base):
    __tablename__ = "usage_hourly"
    __table_args__ = (Index("ix_usage_hourly_hour", "hour"),)

    tenant_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    hour: Mapped[dt.datetime] = mapped_column(UTCDateTime, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    aborted: Mapped[int] = mapped_column(BigInteger, default=0)
    errors: Mapped[int] = mapped_column(BigInteger, default=0)
