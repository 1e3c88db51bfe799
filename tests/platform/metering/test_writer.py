"""The usage writer and the billing export, on SQLite and PostgreSQL: idempotent batches,
retries, rollups equal to the events, export formats and stable ids."""
from __future__ import annotations

import csv
import datetime as dt
import io
import json
import random

import pytest
from loraplex.platform.db.database import make_db_engine
from loraplex.platform.errors import BadRequestError, NotFoundError
from loraplex.platform.metering.writer import Event, EventStore, UsageWriter
from loraplex.platform.tenancy.tenants import create_key, create_tenant
from loraplex.platform.metering.usage import (
    AGGREGATE_COLUMNS,
    EVENT_COLUMNS,
    export_usage,
    parse_time,
    usage_summary,
    usage_totals_raw,
)
from loraplex.platform.db.usage_tables import UsageEvent, UsageHourly
from sqlalchemy import func, select

T0 = 1_799_971_200.0  # 2027-01-15T00:00:00Z, on a day boundary
START = dt.datetime.fromtimestamp(T0, dt.timezone.utc)
CE_REQUIRED = {"specversion", "id", "source", "type", "time", "subject"}


def ev(i: int, tenant_id: int, t: float, adapter: str | None = None, status: str = "length",
       key_id: int | None = None) -> Event:
    prompt, completion = 10 + i % 7, 1 + i % 13
    return Event(f"cmpl-{i:08d}", tenant_id, key_id, adapter, f"sha256:{'ab' * 32}" if adapter else None, i % 3,
                 status, prompt, i % 4, completion, t - 1.5, t - 1.0, t)


@pytest.fixture
def engine(db):
    e = make_db_engine(db.url, pre_ping=False)
    yield e
    e.dispose()


def _count(engine, table) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(table)).scalar()


def _rollup_sums(engine) -> tuple:
    with engine.connect() as conn:
        return tuple(conn.execute(select(func.sum(UsageHourly.requests), func.sum(UsageHourly.prompt_tokens),
                                         func.sum(UsageHourly.completion_tokens))).one())


def test_batches_are_idempotent(db, engine):
    t = create_tenant(db, "acme")
    store = EventStore(engine)
    batch = [ev(i, t.id, T0 + i) for i in range(20)]
    assert store.write(batch) == 20
    sums = _rollup_sums(engine)
    assert store.write(batch) == 0  # a retried batch (the commit had gone through)
    assert store.write(batch[:5] + [ev(100, t.id, T0)] + batch[:2]) == 1  # duplicates within a batch
    assert _count(engine, UsageEvent) == 21
    assert _rollup_sums(engine) == (sums[0] + 1, sums[1] + ev(100, 0, 0).prompt_tokens,
                                    sums[2] + ev(100, 0, 0).completion_tokens)


class Flaky:
    """Wraps EventStore.write: fails `fail` times first, either before or after committing."""

    def __init__(self, store: EventStore, fail: int, after_commit: bool) -> None:
        self.store, self.fail, self.after_commit, self.calls = store, fail, after_commit, 0

    def write(self, events):
        self.calls += 1
        if self.fail > 0:
            self.fail -= 1
            if self.after_commit:
                self.store.write(events)
                raise ConnectionError("connection lost after commit")
            raise ConnectionError("database unavailable")
        return self.store.write(events)


@pytest.mark.parametrize("after_commit", [False, True])
def test_writer_retries_and_never_writes_twice(db, engine, after_commit):
    t = create_tenant(db, "acme")
    w = UsageWriter(engine, batch_size=7, flush_interval=0.01, max_backoff=0.02)
    flaky = Flaky(w.store, 3, after_commit)
    w.store = flaky
    w.start()
    events = [ev(i, t.id, T0 + i) for i in range(30)]
    for e in events:
        w.submit(e)
    assert w.flush(timeout=20)
    w.close()
    assert w.failures == 3 and flaky.calls > 3
    assert _count(engine, UsageEvent) == 30
    assert _rollup_sums(engine) == (30, sum(e.prompt_tokens for e in events), sum(e.completion_tokens for e in events))


def test_backlog_marks_the_writer_overloaded(engine):
    w = UsageWriter(engine, max_buffer=3)  # not started: nothing drains
    for i in range(3):
        assert not w.overloaded
        w.submit(ev(i, 1, T0))
    assert w.overloaded and w.backlog() == 3


@pytest.fixture
def populated(db, engine):
    """400 events over three tenants, two adapters (two versions of one), ~50 hours."""
    tenants = [create_tenant(db, n) for n in ("acme", "beta", "gamma")]
    create_key(db, "acme")
    rnd = random.Random(5)
    events = []
    for i in range(400):
        t = tenants[i % 3]
        adapter = rnd.choice([None, "sql", "chat"])
        e = ev(i, t.id, T0 + rnd.uniform(0, 50 * 3600), adapter, rnd.choice(["stop", "length", "aborted", "error"]))
        if adapter == "sql" and i % 2:
            e.adapter_digest = f"sha256:{'cd' * 32}"  # a second version of sql
        e.correlation_id = f"client-req-{i}" if i % 4 else None  # some requests came without x-request-id
        events.append(e)
    store = EventStore(engine)
    for i in range(0, 400, 64):
        store.write(events[i:i + 64])
    return tenants, events


def test_rollups_equal_the_events(db, populated):
    tenants, events = populated
    end = START + dt.timedelta(days=3)
    for t in tenants:
        mine = [e for e in events if e.tenant_id == t.id]
        total = usage_summary(db, START, end, tenant=t.name, granularity="total", by_adapter=False)
        assert len(total) == 1
        raw = usage_totals_raw(db, START, end, t.id)
        assert (total[0].requests, total[0].prompt_tokens, total[0].cached_tokens, total[0].completion_tokens) == (
            raw["requests"], raw["prompt_tokens"], raw["cached_tokens"], raw["completion_tokens"]) == (
            len(mine), sum(e.prompt_tokens for e in mine), sum(e.cached_tokens for e in mine),
            sum(e.completion_tokens for e in mine))
        assert total[0].aborted == sum(e.status == "aborted" for e in mine)
        assert total[0].errors == sum(e.status == "error" for e in mine)
        for gran in ("hour", "day"):
            rows = usage_summary(db, START, end, tenant=t.name, granularity=gran)
            assert sum(r.total_tokens for r in rows) == sum(e.total_tokens for e in mine)
            for r in rows:  # each row is the sum of its events
                sel = [e for e in mine if r.period_start.timestamp() <= e.finished_at < r.period_end.timestamp()
                       and e.adapter == r.adapter and (r.adapter is None or e.adapter_digest == r.adapter_digest)]
                assert r.requests == len(sel) and r.completion_tokens == sum(e.completion_tokens for e in sel)
    sql = usage_summary(db, START, end, adapter="sql", granularity="total")
    assert {r.adapter_digest for r in sql} == {f"sha256:{'ab' * 32}", f"sha256:{'cd' * 32}"}  # per version
    base = usage_summary(db, START, end, adapter="", granularity="total")
    assert sum(r.requests for r in base) == sum(e.adapter is None for e in events)


def _export(db, fmt, gran="event", **kw) -> bytes:
    return b"".join(export_usage(db, START, START + dt.timedelta(days=3), fmt=fmt, granularity=gran,
                                 include_open=True, **kw))


def test_export_formats_parse_and_ids_are_stable(db, populated):
    _, events = populated
    rows = list(csv.DictReader(io.StringIO(_export(db, "csv").decode())))
    assert len(rows) == 400 and tuple(rows[0]) == EVENT_COLUMNS
    assert sum(int(r["total_tokens"]) for r in rows) == sum(e.total_tokens for e in events)
    assert [r["finished_at"] for r in rows] == sorted(r["finished_at"] for r in rows)
    lines = [json.loads(x) for x in _export(db, "jsonl").splitlines()]
    assert {x["request_id"] for x in lines} == {e.request_id for e in events}
    by_id = {e.request_id: e for e in events}
    for x in lines:
        e = by_id[x["request_id"]]
        assert (x["prompt_tokens"], x["cached_tokens"], x["completion_tokens"], x["status"], x["adapter"]) == (
            e.prompt_tokens, e.cached_tokens, e.completion_tokens, e.status, e.adapter)
        assert x["lane"] in ("interactive", "standard", "batch") and x["finished_at"].endswith("Z")
        assert x["correlation_id"] == e.correlation_id  # joins the line to the request's logs
    assert {r["request_id"]: r["correlation_id"] or None for r in rows} == {
        e.request_id: e.correlation_id for e in events}
    ce = _export(db, "cloudevents")
    assert ce == _export(db, "cloudevents")  # byte-identical on replay: same ids
    ces = [json.loads(x) for x in ce.splitlines()]
    assert all(CE_REQUIRED <= set(c) and c["specversion"] == "1.0" for c in ces)
    assert len({c["id"] for c in ces}) == 400 and {c["subject"] for c in ces} == {"acme", "beta", "gamma"}
    assert {c["id"]: c["data"]["correlation_id"] for c in ces} == {e.request_id: e.correlation_id for e in events}
    for gran in ("hour", "day"):
        agg = list(csv.DictReader(io.StringIO(_export(db, "csv", gran).decode())))
        assert tuple(agg[0]) == AGGREGATE_COLUMNS
        assert sum(int(r["total_tokens"]) for r in agg) == sum(e.total_tokens for e in events)
        first, second = _export(db, "cloudevents", gran), _export(db, "cloudevents", gran)
        assert first == second
        ids = [json.loads(x)["id"] for x in first.splitlines()]
        assert len(ids) == len(set(ids)) == len(agg)
    one = _export(db, "jsonl", tenant="beta")
    assert {json.loads(x)["tenant"] for x in one.splitlines()} == {"beta"}


def test_cloudevents_aggregates_leave_out_open_periods(db, populated):
    _, events = populated
    last = max(e.finished_at for e in events)
    now = (int(last // 3600) + 1) * 3600 + 10  # the last event's hour ended 10 s ago: still open (grace)
    out = b"".join(export_usage(db, START, START + dt.timedelta(days=3), fmt="cloudevents", granularity="hour",
                                now=now))
    periods = {json.loads(x)["data"]["period_start"] for x in out.splitlines()}
    assert dt.datetime.fromtimestamp(int(last // 3600) * 3600, dt.timezone.utc).isoformat().replace(
        "+00:00", "Z") not in periods and periods


@pytest.mark.parametrize("kw, match", [
    ({"fmt": "xml"}, "format must be one of"),
    ({"granularity": "week"}, "granularity must be one of"),
    ({"tenant": "nobody"}, "no tenant named"),
])
def test_export_argument_errors(db, kw, match):
    with pytest.raises((BadRequestError, NotFoundError), match=match):
        export_usage(db, START, START + dt.timedelta(hours=1), **kw)


def test_parse_time_and_alignment(db):
    assert parse_time("2027-01-15") == dt.datetime(2027, 1, 15, tzinfo=dt.timezone.utc)
    assert parse_time("2027-01-15T10:00:00Z") == parse_time("2027-01-15T12:00:00+02:00")
    assert parse_time("2027-01-15T10:00").tzinfo == dt.timezone.utc
    with pytest.raises(BadRequestError, match="not an ISO date"):
        parse_time("yesterday", "--from")
    with pytest.raises(BadRequestError, match="not on an hour boundary"):
        export_usage(db, START + dt.timedelta(minutes=5), START + dt.timedelta(hours=2), granularity="hour")
    with pytest.raises(BadRequestError, match="must be after"):
        export_usage(db, START, START)
