"""Usage queries (for dashboards and the admin API) and the billing export.

Times are UTC; every range is half-open, [start, end). An event belongs to the time its
request finished (`finished_at`): that is when its tokens are known and billed.

- `usage_summary()` reads the hourly rollups: cheap at any number of events.
- `usage_events()` streams raw events (server-side cursor), for per-event export.
- `export_usage()` yields the bytes of an export: csv, jsonl or cloudevents (one
  CloudEvents 1.0 JSON object per line, structured mode), per event or aggregated per
  hour or day.

CloudEvents ids are stable: a request's event has the request's id (the `id` the client
got back), an aggregate has `usage-<hour|day>-<tenant id>-<adapter version id>-<period>`,
so an export replayed into OpenMeter, Lago or Stripe de-duplicates there. Aggregates of a
period that is not over (plus `OPEN_GRACE` seconds for late writes) are left out of a
CloudEvents export unless `include_open=True`: an aggregate sent early and corrected
later would carry the same id and be dropped as a duplicate.
"""
from __future__ import annotations

import csv
import datetime as dt
import io
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import orjson
from loraplex.platform.lanes import Lane, lane_name
from sqlalchemy import func, literal, select

from loraplex.platform.db.database import Database
from loraplex.platform.errors import BadRequestError, NotFoundError
from loraplex.platform.db.tables import ApiKey, Tenant
from loraplex.platform.db.usage_tables import UsageAdapter, UsageEvent, UsageHourly

FORMATS = ("csv", "jsonl", "cloudevents")
GRANULARITIES = ("event", "hour", "day")
OPEN_GRACE = 300.0  # seconds after a period's end before its aggregate counts as final
DEFAULT_SOURCE = "//loraplex/usage"
EVENT_TYPE = "com.loraplex.usage.request"
AGGREGATE_TYPES = {"hour": "com.loraplex.usage.hourly", "day": "com.loraplex.usage.daily"}
_LANES = {int(lane): lane_name(lane) for lane in Lane}
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


# -- time ---------------------------------------------------------------------------------
def parse_time(text: str, name: str = "time") -> dt.datetime:
    """An ISO 8601 date (midnight UTC) or date-time (UTC unless it has an offset; a
    trailing Z is fine)."""
    value = (text or "").strip()
    try:
        if _DATE_RE.fullmatch(value):
            d = dt.date.fromisoformat(value)
            return dt.datetime(d.year, d.month, d.day, tzinfo=dt.timezone.utc)
        t = dt.datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise BadRequestError(f"{name} {text!r} is not an ISO date (2026-01-31) or time "
                              f"(2026-01-31T12:00:00Z)", name) from None
    return t.replace(tzinfo=dt.timezone.utc) if t.tzinfo is None else t.astimezone(dt.timezone.utc)


def _check_range(start: dt.datetime, end: dt.datetime, granularity: str) -> None:
    if start.tzinfo is None or end.tzinfo is None:
        raise BadRequestError("times must be timezone-aware (UTC)")
    if end <= start:
        raise BadRequestError(f"the end ({end.isoformat()}) must be after the start ({start.isoformat()})")
    step = {"hour": 3600, "day": 86400}.get(granularity)
    if step is not None:
        for name, t in (("from", start), ("to", end)):
            if t.timestamp() % step:
                raise BadRequestError(f"--{name} {t.isoformat()} is not on a{'n hour' if step == 3600 else ' day'} "
                                      f"boundary, which --granularity {granularity} needs", name)


def _iso(t: dt.datetime | None) -> str | None:
    if t is None:
        return None
    return t.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _tenant_id(db: Database, tenant: str | None) -> int | None:
    if tenant is None:
        return None
    with db.engine.connect() as conn:
        tid = conn.execute(select(Tenant.id).where(Tenant.name == tenant)).scalar()
    if tid is None:
        raise NotFoundError(f"no tenant named {tenant!r}")
    return tid


# -- rollups ------------------------------------------------------------------------------
@dataclass(frozen=True)
class UsageRow:
    """Usage of one tenant and adapter version over one period (from the rollups)."""

    period_start: dt.datetime
    period_end: dt.datetime
    tenant_id: int
    tenant: str
    adapter: str | None  # None: the base model
    adapter_digest: str | None
    adapter_id: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    aborted: int
    errors: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict:
        return {"period_start": _iso(self.period_start), "period_end": _iso(self.period_end),
                "tenant": self.tenant, "tenant_id": self.tenant_id, "adapter": self.adapter,
                "adapter_digest": self.adapter_digest, "requests": self.requests,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, "total_tokens": self.total_tokens,
                "aborted": self.aborted, "errors": self.errors}


_SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "aborted", "errors")


def iter_usage(db: Database, start: dt.datetime, end: dt.datetime, *, tenant: str | None = None,
               adapter: str | None = None, granularity: str = "hour", by_adapter: bool = True
               ) -> Iterator[UsageRow]:
    """Rollup rows per period ("hour", "day" or "total") and tenant, per adapter version
    (`by_adapter`) or all adapters together (adapter None, adapter_id -1), in period order.
    `adapter` filters by adapter name ("" for the base model)."""
    if granularity not in ("hour", "day", "total"):
        raise BadRequestError(f"granularity must be hour, day or total, got {granularity!r}", "granularity")
    _check_range(start, end, granularity if granularity != "total" else "hour")
    tid = _tenant_id(db, tenant)
    h = UsageHourly
    pg = db.engine.dialect.name == "postgresql"
    # The database sums hours into days or the whole range: a month is one short query.
    if granularity == "hour":
        period = h.hour
    elif granularity == "day":
        period = func.date_trunc("day", h.hour, "UTC") if pg else func.substr(h.hour, 1, 10)
    else:
        period = literal(0)
    adapter_col = h.adapter_id if by_adapter else literal(-1)
    agg = (select(period.label("period"), h.tenant_id.label("tenant_id"), adapter_col.label("adapter_id"),
                  *(func.sum(getattr(h, c)).label(c) for c in _SUMS))
           .where(h.hour >= start, h.hour < end).group_by(period, h.tenant_id, adapter_col))
    if tid is not None:
        agg = agg.where(h.tenant_id == tid)
    if adapter == "":
        agg = agg.where(h.adapter_id == 0)
    elif adapter is not None:
        agg = agg.where(h.adapter_id.in_(select(UsageAdapter.id).where(UsageAdapter.name == adapter)))
    a = agg.subquery()
    q = (select(a.c.period, a.c.tenant_id, Tenant.name, a.c.adapter_id, UsageAdapter.name, UsageAdapter.digest,
                *(getattr(a.c, c) for c in _SUMS))
         .outerjoin(Tenant, Tenant.id == a.c.tenant_id).outerjoin(UsageAdapter, UsageAdapter.id == a.c.adapter_id)
         .order_by(a.c.period, a.c.tenant_id, a.c.adapter_id))
    with db.engine.connect() as conn:
        for row in conn.execution_options(yield_per=2000).execute(q):
            if granularity == "total":
                p0, p1 = start, end
            else:
                p0 = _period_start(row[0])
                p1 = p0 + (dt.timedelta(hours=1) if granularity == "hour" else dt.timedelta(days=1))
            yield UsageRow(p0, p1, row[1], row[2] or f"tenant-{row[1]}", row[4], row[5], row[3],
                           *(int(v or 0) for v in row[6:]))


def _period_start(value) -> dt.datetime:
    if isinstance(value, str):  # SQLite day: "YYYY-MM-DD"
        d = dt.date.fromisoformat(value[:10])
        return dt.datetime(d.year, d.month, d.day, tzinfo=dt.timezone.utc)
    if value.tzinfo is None:  # SQLite hour (UTCDateTime column read raw)
        return value.replace(tzinfo=dt.timezone.utc)
    return value.astimezone(dt.timezone.utc)


def usage_summary(db: Database, start: dt.datetime, end: dt.datetime, *, tenant: str | None = None,
                  adapter: str | None = None, granularity: str = "day", by_adapter: bool = True) -> list[UsageRow]:
    """`iter_usage` as a list: per tenant (and adapter) and hour, day, or the whole range ("total")."""
    return list(iter_usage(db, start, end, tenant=tenant, adapter=adapter, granularity=granularity,
                           by_adapter=by_adapter))


def usage_totals_raw(db: Database, start: dt.datetime, end: dt.datetime, tenant_id: int) -> dict:
    """The same sums straight from the events (reconciliation, benchmarks): slow at scale."""
    e = UsageEvent
    q = select(func.count(), func.coalesce(func.sum(e.prompt_tokens), 0), func.coalesce(func.sum(e.cached_tokens), 0),
               func.coalesce(func.sum(e.completion_tokens), 0)).where(
        e.tenant_id == tenant_id, e.finished_at >= start, e.finished_at < end)
    with db.engine.connect() as conn:
        n, p, c, o = conn.execute(q).one()
    return {"requests": int(n), "prompt_tokens": int(p), "cached_tokens": int(c), "completion_tokens": int(o)}


# -- events -------------------------------------------------------------------------------
@dataclass(frozen=True)
class UsageEventRow:
    request_id: str
    tenant_id: int
    tenant: str
    key_prefix: str | None
    adapter: str | None
    adapter_digest: str | None
    lane: str
    status: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    received_at: dt.datetime
    first_token_at: dt.datetime | None
    finished_at: dt.datetime
    # The HTTP request's x-request-id (the client's, or the gateway's when it sent none):
    # what joins a usage line to the request's log lines and trace.
    correlation_id: str | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict:
        return {"request_id": self.request_id, "tenant": self.tenant, "tenant_id": self.tenant_id,
                "key_prefix": self.key_prefix, "adapter": self.adapter, "adapter_digest": self.adapter_digest,
                "lane": self.lane, "status": self.status, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens, "received_at": _iso(self.received_at),
                "first_token_at": _iso(self.first_token_at), "finished_at": _iso(self.finished_at),
                "correlation_id": self.correlation_id}


def _aware(t: dt.datetime | None) -> dt.datetime | None:
    return t if t is None or t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


def usage_events(db: Database, start: dt.datetime, end: dt.datetime, *, tenant: str | None = None,
                 batch: int = 2000) -> Iterator[UsageEventRow]:
    """Raw events finished in [start, end), oldest first, streamed."""
    _check_range(start, end, "event")
    tid = _tenant_id(db, tenant)
    e = UsageEvent
    q = (select(e.request_id, e.tenant_id, Tenant.name, ApiKey.prefix, UsageAdapter.name, UsageAdapter.digest,
                e.lane, e.status, e.prompt_tokens, e.cached_tokens, e.completion_tokens, e.received_at,
                e.first_token_at, e.finished_at, e.correlation_id)
         .outerjoin(Tenant, Tenant.id == e.tenant_id).outerjoin(ApiKey, ApiKey.id == e.key_id)
         .outerjoin(UsageAdapter, UsageAdapter.id == e.adapter_id)
         .where(e.finished_at >= start, e.finished_at < end).order_by(e.finished_at, e.id))
    if tid is not None:
        q = q.where(e.tenant_id == tid)
    with db.engine.connect() as conn:
        for r in conn.execution_options(yield_per=batch).execute(q):
            yield UsageEventRow(r[0], r[1], r[2] or f"tenant-{r[1]}", r[3], r[4], r[5], _LANES.get(r[6], str(r[6])),
                                r[7], r[8], r[9], r[10], _aware(r[11]), _aware(r[12]), _aware(r[13]), r[14])


# -- export -------------------------------------------------------------------------------
# correlation_id comes last so that CSV readers that go by position keep working.
EVENT_COLUMNS = ("request_id", "tenant", "tenant_id", "key_prefix", "adapter", "adapter_digest", "lane", "status",
                 "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens", "received_at",
                 "first_token_at", "finished_at", "correlation_id")
AGGREGATE_COLUMNS = ("period_start", "period_end", "tenant", "tenant_id", "adapter", "adapter_digest", "requests",
                     "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens", "aborted", "errors")


def event_cloudevent(row: UsageEventRow, source: str = DEFAULT_SOURCE) -> dict:
    data = row.as_dict()
    return {"specversion": "1.0", "id": row.request_id, "source": source, "type": EVENT_TYPE,
            "subject": row.tenant, "time": _iso(row.finished_at), "datacontenttype": "application/json",
            "data": data}


def aggregate_id(granularity: str, row: UsageRow) -> str:
    stamp = row.period_start.strftime("%Y%m%dT%H" if granularity == "hour" else "%Y%m%d")
    return f"usage-{granularity}-{row.tenant_id}-{row.adapter_id}-{stamp}"


def aggregate_cloudevent(granularity: str, row: UsageRow, source: str = DEFAULT_SOURCE) -> dict:
    return {"specversion": "1.0", "id": aggregate_id(granularity, row), "source": source,
            "type": AGGREGATE_TYPES[granularity], "subject": row.tenant, "time": _iso(row.period_start),
            "datacontenttype": "application/json", "data": row.as_dict()}


# A spreadsheet opening the export runs a cell that starts with one of these as a formula
# (OWASP's CSV injection rule); names and request ids come from clients.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value):
    """`value` as a CSV cell a spreadsheet shows as text: a string that would start a
    formula gets a leading apostrophe; numbers stay numbers and None is empty."""
    if value is None:
        return ""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def _csv_line(values) -> bytes:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow([csv_cell(v) for v in values])
    return buf.getvalue().encode()


@dataclass
class ExportStats:
    """Filled in as an export is consumed."""

    records: int = 0
    skipped_open_periods: int = 0


def export_usage(db: Database, start: dt.datetime, end: dt.datetime, *, fmt: str = "csv",
                 granularity: str = "event", tenant: str | None = None, source: str = DEFAULT_SOURCE,
                 include_open: bool = False, stats: ExportStats | None = None, now: float | None = None
                 ) -> Iterator[bytes]:
    """The export's bytes, a chunk per record (csv has a header line first). Validates its
    arguments before yielding anything, so a bad argument raises at the first next()."""
    if fmt not in FORMATS:
        raise BadRequestError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}", "format")
    if granularity not in GRANULARITIES:
        raise BadRequestError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}",
                              "granularity")
    _check_range(start, end, granularity)
    _tenant_id(db, tenant)  # an unknown tenant is an error, not an empty export
    stats = stats if stats is not None else ExportStats()
    return _export(db, start, end, fmt, granularity, tenant, source, include_open, stats,
                   time.time() if now is None else now)


def _encode(row, fmt: str, columns: tuple[str, ...], cloudevent) -> bytes:
    """One exported record: a CSV line of `columns`, a JSON line, or `cloudevent()` as a JSON line."""
    if fmt == "csv":
        d = row.as_dict()
        return _csv_line(d[c] for c in columns)
    return orjson.dumps(row.as_dict() if fmt == "jsonl" else cloudevent()) + b"\n"


def _export(db, start, end, fmt, granularity, tenant, source, include_open, stats, now) -> Iterator[bytes]:
    if granularity == "event":
        if fmt == "csv":
            yield _csv_line(EVENT_COLUMNS)
        for row in usage_events(db, start, end, tenant=tenant):
            stats.records += 1
            yield _encode(row, fmt, EVENT_COLUMNS, lambda: event_cloudevent(row, source))
        return
    if fmt == "csv":
        yield _csv_line(AGGREGATE_COLUMNS)
    for row in iter_usage(db, start, end, tenant=tenant, granularity=granularity):
        if fmt == "cloudevents" and not include_open and row.period_end.timestamp() + OPEN_GRACE > now:
            stats.skipped_open_periods += 1
            continue
        stats.records += 1
        yield _encode(row, fmt, AGGREGATE_COLUMNS, lambda: aggregate_cloudevent(granularity, row, source))
