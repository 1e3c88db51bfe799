"""The usage journal and crash recovery: group commit, segment
rotation and deletion, and recovery of a `kill -9`'d process's journal into the database
exactly once (on SQLite and PostgreSQL), settling its quota leases."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import orjson
import pytest

from loraplex.platform.db.database import make_db_engine
from loraplex.platform.db.usage_tables import QuotaLease, UsageEvent
from loraplex.platform.metering.frames import read_records
from loraplex.platform.metering.journal import Journal
from loraplex.platform.metering.ledger import JournalConfig, Ledger, final_events, record
from loraplex.platform.metering.writer import Event, EventStore, UsageWriter
from loraplex.platform.quotas.admission import plan_admission
from loraplex.platform.quotas.limits import quota_status, set_quota, tenant_scope
from loraplex.platform.quotas.dialects import open_quota_store
from loraplex.platform.tenancy.tenants import create_tenant
from sqlalchemy import func, select

from tests.platform.metering.test_writer import T0, Flaky, ev


def _count(engine, table) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(table)).scalar()


def test_a_pinned_segment_reads_back_whole_after_close(tmp_path):
    # Framing and damage are frames.py's (test_frames.py): here, the journal's own file.
    j = Journal(tmp_path, "a")
    for i in range(5):
        lsn, _seg = j.append({"i": i}, pins=1)
    assert j.wait_durable(lsn)
    (path,) = tmp_path.glob("usage-a-*.journal")
    j.close()
    assert path.exists(), "pinned records are never deleted"
    seg = read_records(path)
    assert [r["i"] for r in seg.records] == list(range(5)) and seg.clean


def test_group_commit_and_segment_deletion(tmp_path):
    j = Journal(tmp_path, "a", max_segment_bytes=200)
    appended = [j.append({"n": i, "pad": "x" * 40}, pins=1) for i in range(200)]
    assert j.wait_durable(appended[-1][0])
    assert j.fsyncs < 200, "one fsync covers every record appended meanwhile"
    segments = sorted({seg for _lsn, seg in appended})
    assert len(segments) > 10 and len(list(tmp_path.glob("*.journal"))) == len(segments)
    for _lsn, seg in appended:
        j.unpin(seg)
    # Closed segments with nothing pinned are gone; the current one stays until close.
    assert len(list(tmp_path.glob("*.journal"))) == 1
    assert j.close() and not list(tmp_path.iterdir())


_DEAD = textwrap.dedent("""
    import os, signal, sys
    from loraplex.platform.metering.journal import Journal
    from loraplex.platform.metering.ledger import record
    from loraplex.platform.metering.writer import Event
    from tests.platform.metering.test_writer import T0, ev
    tid, scope = int(sys.argv[2]), "t:" + sys.argv[2]
    charges = [[scope, "conc", 0, 1], [scope, "budget", int(sys.argv[3]), 100]]
    j = Journal(sys.argv[1], "dead")
    for i in range(6):
        e = ev(i, tid, T0 + i)
        if i < 4:  # finished: a final event (the first one holds a lease to settle)
            lsn, _ = j.append(record("e", e, charges if i == 0 else None), pins=1)
        else:  # in flight at the crash: checkpoints only, the last one counts
            for n in (1, 2, 3):
                e.status, e.completion_tokens = "error", n
                lsn, _ = j.append(record("c", e, charges if i == 5 else None), pins=1)
    j.wait_durable(lsn)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _journal_of_a_killed_process(tmp_path, tid: int, window: int) -> None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-c", _DEAD, str(tmp_path), str(tid), str(window)], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (path,) = tmp_path.glob("usage-dead-*.journal")
    with open(path, "ab") as f:
        f.write(b"\x30\x00\x00\x00garbage")  # and a torn tail


def _ledger(engine, store, tmp_path, owner: str) -> Ledger:
    journal = Journal(tmp_path, owner)
    writer = UsageWriter(engine, flush_interval=0.01, max_backoff=0.02, journal=journal)
    return Ledger(journal, writer, store.settle, JournalConfig(tmp_path))


def test_a_killed_process_is_recovered_exactly_once(db, tmp_path):
    t = create_tenant(db, "acme")
    engine = make_db_engine(db.url, pre_ping=False)
    store = open_quota_store(engine, "dead", lease_ttl=600)
    lim = set_quota(db, "acme", max_concurrency=5, token_budget=1000, budget_period="month").limits
    checks = plan_admission([(tenant_scope(t.id), "tenant acme", lim)], 100, T0)
    store.reserve("cmpl-00000000", checks, T0)
    store.reserve("cmpl-00000005", checks, T0)
    window = next(c.window for c in checks if c.kind == "budget")
    _journal_of_a_killed_process(tmp_path, t.id, window)

    # A first restart takes the dead journal over, but the database refuses everything
    # and that process stops too: the events live on in its own journal only.
    b = _ledger(engine, store, tmp_path, "b")
    b.writer.store = Flaky(b.writer.store, 10**9, False)
    b.writer.start()
    assert b.recover() == 6
    assert not list(tmp_path.glob("usage-dead-*"))
    b.writer.close(timeout=0.2)
    assert not b.journal.close() and _count(engine, UsageEvent) == 0
    # Two of its events reached the database after all (a commit whose answer was lost).
    EventStore(engine).write([ev(1, t.id, T0 + 1), ev(2, t.id, T0 + 2)])

    c = _ledger(engine, store, tmp_path, "c")
    c.writer.start()
    assert c.recover() == 6
    assert c.writer.flush(20)
    c.writer.close()
    assert c.journal.close(), "everything is in the database: the journal is deleted"
    assert not list(tmp_path.glob("*.journal"))
    with engine.connect() as conn:
        rows = dict(conn.execute(select(UsageEvent.request_id, UsageEvent.completion_tokens)).all())
        statuses = dict(conn.execute(select(UsageEvent.request_id, UsageEvent.status)).all())
        leases = conn.execute(select(func.count()).select_from(QuotaLease)).scalar()
    assert rows == {f"cmpl-{i:08d}": (ev(i, 0, 0).completion_tokens if i < 4 else 3) for i in range(6)}
    assert statuses["cmpl-00000005"] == "error" and statuses["cmpl-00000000"] == "length"
    assert c.writer.written == 4 and c.writer.duplicates == 2
    st = quota_status(db, "acme", now=T0)
    assert leases == 0 and st.in_flight == 0
    assert st.budget_used == ev(0, 0, 0).total_tokens + ev(5, 0, 0).prompt_tokens + 3
    store.close()
    engine.dispose()


def test_final_event_wins_over_checkpoints():
    e = ev(1, 1, T0)
    ck = Event(**{**record("c", e, None)["e"], "status": "error", "completion_tokens": 0})
    recs = [record("c", ck, None), record("e", e, [["t:1", "conc", 0, 1]]), record("c", ck, None)]
    ((got, charges),) = final_events(recs)
    assert got == e and charges == [("t:1", "conc", 0, 1)]
    assert final_events([record("c", ck, None)]) == [(ck, None)]


_FULL = textwrap.dedent("""
    import asyncio, resource, signal, sys
    from loraplex.platform.metering.journal import Journal, JournalError
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    j = Journal(sys.argv[1], "full")
    acked = 0
    try:
        while True:
            lsn, _ = j.append({"pad": "x" * 100}, pins=1)
            asyncio.run(j.durable(lsn))
            acked += 1
    except JournalError as exc:
        print("acked", acked, "error", exc)
    try:
        j.append({"after": 1})
        print("appended after the failure")
    except JournalError:
        print("refused after the failure")
""")


def test_a_full_disk_fails_loudly_and_acknowledges_nothing_more(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-c", _FULL, str(tmp_path)], cwd=root, capture_output=True, text=True,
                          timeout=120, check=True)
    first, second = proc.stdout.splitlines()
    acked = int(first.split()[1])
    assert 0 < acked and "cannot be written" in first and second == "refused after the failure"
    (path,) = tmp_path.glob("usage-full-*.journal")
    assert len(read_records(path).records) >= acked, "every acknowledged record is on disk"


def test_live_journals_are_never_claimed_and_empty_dead_ones_are_swept(tmp_path):
    a, b = Journal(tmp_path, "a"), Journal(tmp_path, "b")
    assert a.wait_durable(a.append({"x": 1}, pins=1)[0])
    (tmp_path / "usage-gone.lock").touch()  # a process that died with nothing journalled
    assert b.orphans() == [], "a is alive: its flock is held"
    assert not (tmp_path / "usage-gone.lock").exists()
    assert not a.close()  # a record still pinned: kept, and a's lock is free now
    (orphan,) = b.orphans()
    assert orphan.owner == "a" and list(orphan.records()) == [{"x": 1}]
    assert b.orphans() == [], "claimed by one process at a time"
    orphan.release(delete=True)
    assert b.close() and not list(tmp_path.iterdir())


def test_recovery_keeps_the_records_after_a_damaged_one_and_reports_the_loss(db, tmp_path):
    """A stopped process's journal with one corrupted byte in its second event: a restart
    bills every other event and says what it skipped (log line and /metrics series)."""
    import asyncio

    from prometheus_client import CollectorRegistry, generate_latest

    from loraplex.platform.assembly.usage_hooks import UsageHooks
    from loraplex.platform.settings import Settings, UsageConfig

    t = create_tenant(db, "acme")
    folder = tmp_path / "usage-journal"
    dead = Journal(folder, "dead")
    for i in range(5):
        lsn, _seg = dead.append(record("e", ev(i, t.id, T0 + i), None), pins=1)
    assert dead.wait_durable(lsn) and not dead.close()
    (path,) = folder.glob("usage-dead-*.journal")
    first = read_records(path)
    damaged = bytearray(path.read_bytes())
    damaged[len(orjson.dumps(first.records[0])) + 8 + 30] ^= 0x20  # inside the second record's payload
    path.write_bytes(bytes(damaged))

    async def main() -> bytes:
        hooks = UsageHooks(Settings(database_url=db.url, data_dir=tmp_path, usage=UsageConfig(flush_seconds=0.01)))
        registry = CollectorRegistry()
        hooks.register_metrics(registry)
        await hooks.start()
        assert await asyncio.to_thread(hooks.metering.writer.flush, 20)
        text = generate_latest(registry)
        await hooks.close()
        return text

    metrics = asyncio.run(asyncio.wait_for(main(), 60)).decode()
    engine = make_db_engine(db.url, pre_ping=False)
    try:
        with engine.connect() as conn:
            billed = set(conn.execute(select(UsageEvent.request_id)).scalars())
    finally:
        engine.dispose()
    assert billed == {f"cmpl-{i:08d}" for i in (0, 2, 3, 4)}
    assert "loraplex:usage_journal_skipped_records_total 1.0" in metrics
    assert f"loraplex:usage_journal_skipped_bytes_total {len(orjson.dumps(first.records[1])) + 8}.0" in metrics


def test_a_journal_is_claimed_only_by_its_own_database(tmp_path, caplog):
    dead = Journal(tmp_path, "dead")
    dead.bind("db-one")
    assert dead.wait_durable(dead.append({"x": 1}, pins=1)[0]) and not dead.close()
    legacy = Journal(tmp_path, "legacy")  # written before journals named their database
    assert legacy.wait_durable(legacy.append({"y": 1}, pins=1)[0]) and not legacy.close()
    other = Journal(tmp_path, "other")
    other.bind("db-two")
    (orphan,) = other.orphans()
    assert orphan.owner == "legacy"
    orphan.release(delete=True)
    assert other.orphans() == [] and other.orphans() == []
    assert sum("belongs to another database (db-one)" in r.message for r in caplog.records) == 1
    assert list(tmp_path.glob("usage-dead-*.journal")), "left for a process of its own database"
    own = Journal(tmp_path, "own")
    own.bind("db-one")
    (orphan,) = own.orphans()
    assert orphan.owner == "dead" and list(orphan.records()) == [{"x": 1}]
    orphan.release(delete=True)
    assert other.close() and own.close() and not list(tmp_path.iterdir())


def test_a_data_dir_reused_with_another_database_bills_nothing_there(db, tmp_path, pg_schema_url):
    """A gateway's data dir holds a stopped process's journal of database A; a gateway on
    database B with the same data dir leaves it (B's tenant of the same id is not billed);
    a gateway on A then bills it."""
    import asyncio

    from loraplex.platform.assembly.usage_hooks import UsageHooks
    from loraplex.platform.db.database import Database, database_id, migrate
    from loraplex.platform.settings import Settings, UsageConfig

    from tests.platform.fixtures import fresh_db_url

    other_url = fresh_db_url("sqlite" if db.url.startswith("sqlite") else "postgresql", tmp_path, pg_schema_url)
    migrate(other_url)
    other = Database(other_url)
    t = create_tenant(db, "acme")
    assert create_tenant(other, "someone-else").id == t.id, "tenant ids are per database"
    engine = make_db_engine(db.url, pre_ping=False)
    dead = Journal(tmp_path / "usage-journal", "dead")
    dead.bind(database_id(engine))
    for i in range(3):
        lsn, _seg = dead.append(record("e", ev(i, t.id, T0 + i), None), pins=1)
    assert dead.wait_durable(lsn) and not dead.close()

    def billed(database: Database) -> set[str]:
        with database.engine.connect() as conn:
            return set(conn.execute(select(UsageEvent.request_id)).scalars())

    async def gateway(url: str) -> int:
        hooks = UsageHooks(Settings(database_url=url, data_dir=tmp_path, usage=UsageConfig(flush_seconds=0.01)))
        await hooks.start()
        assert await asyncio.to_thread(hooks.metering.writer.flush, 20)
        recovered = hooks.metering.ledger.recovered
        await hooks.close()
        return recovered

    try:
        assert asyncio.run(asyncio.wait_for(gateway(other_url), 60)) == 0
        assert billed(other) == set()
        assert list((tmp_path / "usage-journal").glob("usage-dead-*.journal"))
        assert asyncio.run(asyncio.wait_for(gateway(db.url), 60)) == 3
        assert billed(db) == {f"cmpl-{i:08d}" for i in range(3)}
        assert not list((tmp_path / "usage-journal").glob("*.journal"))
    finally:
        engine.dispose()
        other.dispose()
