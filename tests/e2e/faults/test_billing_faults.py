"""Billing survives crashes, on real processes over PostgreSQL (through a loopback proxy
the test controls): `kill -9` of `loraplex serve` mid-stream, then a restart, bills what
the clients received within the documented bound and nothing twice; PostgreSQL made
unreachable mid-load serves tenants without limits, refuses (503) those with limits,
keeps every event and writes it exactly once when the database is back; reservations
return to zero after every path. One server start per phase, shared by the checks."""
from __future__ import annotations

import datetime as dt
import time
from urllib.parse import urlsplit, urlunsplit

import httpx
import orjson
import pytest
from loraplex.platform.db.database import Database, migrate
from loraplex.platform.db.usage_tables import QuotaLease, UsageEvent
from loraplex.platform.metering.usage import export_usage, usage_summary
from loraplex.platform.quotas.limits import quota_status, set_quota
from loraplex.platform.tenancy.tenants import create_key, create_tenant
from sqlalchemy import func, select

from tests.e2e.faults.support import Serve, Stream, TcpProxy

CHECKPOINT_TOKENS, CHECKPOINT_SECONDS = 16, 1.0  # ledger.JournalConfig's defaults
CLIENT_SLACK = 0.5  # seconds between the server handing a token on and the client reading it


@pytest.fixture(scope="module")
def site(pg_schema_url, tiny_llama_dir, tmp_path_factory):
    url = pg_schema_url()
    migrate(url)
    db = Database(url)
    create_tenant(db, "capped")
    create_tenant(db, "free")
    set_quota(db, "capped", max_concurrency=20, token_budget=10**7, budget_period="month")
    keys = {t: create_key(db, t) for t in ("capped", "free")}
    u = urlsplit(url)
    proxy = TcpProxy((u.hostname, u.port or 5432))
    proxied = urlunsplit(u._replace(netloc=f"{u.username + '@' if u.username else ''}127.0.0.1:{proxy.port}"))
    data = tmp_path_factory.mktemp("faults")
    args = ["--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--database-url", proxied,
            "--data-dir", str(data), "--no-demo", "--dtype", "float32", "--threads", "1",
            "--num-kv-blocks", "640", "--max-model-len", "2048", "--max-num-seqs", "16"]
    running: list[Serve] = []  # a server left running by one test, for the next
    yield db, keys, proxy, args, data, running
    for serve in running:
        serve.kill9()
    proxy.cut()
    db.dispose()


def _start(args, data, n: int) -> Serve:
    s = Serve(args, data / f"serve-{n}.log")
    s.wait_ready()
    return s


def _events(db, ids) -> dict[str, tuple[int, int, str]]:
    with db.engine.connect() as conn:
        rows = conn.execute(select(UsageEvent.request_id, UsageEvent.prompt_tokens, UsageEvent.completion_tokens,
                                   UsageEvent.status).where(UsageEvent.request_id.in_(list(ids)))).all()
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


def _wait_events(db, ids, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        got = _events(db, ids)
        if len(got) == len(ids) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _reservations_zero(db, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with db.engine.connect() as conn:
            leases = conn.execute(select(func.count()).select_from(QuotaLease)).scalar()
        if (leases, quota_status(db, "capped").in_flight) == (0, 0):
            return
        assert time.monotonic() < deadline, f"{leases} quota leases left"
        time.sleep(0.2)


def _exported(db) -> list[dict]:
    now = dt.datetime.now(dt.timezone.utc)
    return [orjson.loads(line) for line in export_usage(db, now - dt.timedelta(days=1), now + dt.timedelta(days=1),
                                                        fmt="jsonl")]


def _complete(url: str, key: str, max_tokens: int = 5) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": "tiny", "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True})


def test_kill_9_mid_stream_bills_what_clients_received(site):
    db, keys, _proxy, args, data, running = site
    serve = _start(args, data, 1)
    done = [_complete(serve.url, keys["capped"]) for _ in range(3)]
    assert all(r.status_code == 200 for r in done), done[0].text
    done = [r.json() for r in done]
    streams = [Stream(serve.url, keys[t], 2000) for t in ("capped", "capped", "free", "capped")]
    threads = [s.start() for s in streams]
    deadline = time.monotonic() + 120
    # Long enough that every stream checkpointed past its first output (16 tokens and 1 s).
    while not all(s.received >= 40 and s.times[-1] - s.times[0] > 2 * CHECKPOINT_SECONDS for s in streams):
        assert all(t.is_alive() for t in threads), [(s.received, s.error) for s in streams]
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.01)
    serve.kill9()
    for t in threads:
        t.join(30)
    assert all(s.request_id and not s.finished for s in streams), [(s.received, s.error) for s in streams]
    assert list(data.glob("usage-journal/*.journal")), "the killed process left its journal"

    serve = _start(args, data, 2)  # recovers the dead process's journal
    try:
        ids = {d["id"] for d in done} | {s.request_id for s in streams}
        billed = _wait_events(db, ids)
        assert billed.keys() == ids
        for d in done:
            assert billed[d["id"]][1:] == (d["usage"]["completion_tokens"], "length")
        for s in streams:
            _prompt, completion, status = billed[s.request_id]
            bound = max(CHECKPOINT_TOKENS, 1 + s.received_in_last(CHECKPOINT_SECONDS + CLIENT_SLACK))
            assert status == "error"
            assert 0 < completion <= s.received and s.received - completion <= bound, (s.received, completion, bound)
        _reservations_zero(db)
        st = quota_status(db, "capped")
        assert st.budget_used == sum(p + c for rid, (p, c, _s) in billed.items()
                                     if rid not in {streams[2].request_id})
        exported = [e for e in _exported(db) if e["request_id"] in ids]
        assert sorted(e["request_id"] for e in exported) == sorted(ids), "each request exported once"
        totals = usage_summary(db, *_day(), granularity="total")
        assert sum(r.requests for r in totals) == len(_exported(db)), "rollups count each event once"
        assert len(list((data / "usage-journal").glob("*.journal"))) == 1, "the dead journal is gone"
    except BaseException:
        serve.stop()
        raise
    running.append(serve)


def _day():
    now = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
    return now - dt.timedelta(days=1), now + dt.timedelta(days=1)


def test_postgres_unreachable_mid_load(site):
    db, keys, proxy, args, data, running = site
    serve = running.pop() if running else _start(args, data, 3)
    try:
        for t in ("capped", "free"):  # keys and limits in the server's caches
            assert _complete(serve.url, keys[t]).status_code == 200
        running = [Stream(serve.url, keys["capped"], 300) for _ in range(2)]
        threads = [s.start() for s in running]
        while min(s.received for s in running) < 5 and all(t.is_alive() for t in threads):
            time.sleep(0.01)
        proxy.cut()
        during = {t: [_complete(serve.url, keys[t]) for _ in range(3)] for t in ("free", "capped")}
        for t in threads:
            t.join(120)
        proxy.restore()
        assert during["free"][0].status_code == 200, during["free"][0].text  # served within cached decisions
        for t, responses in during.items():
            for r in responses:
                assert r.status_code in (200, 503), r.text
                if r.status_code == 503:
                    assert r.json()["error"]["code"] in ("metering_unavailable", "database_unavailable")
                    assert r.headers["retry-after"]
        assert all(r.status_code == 503 for r in during["capped"]), "limits cannot be enforced: refused"
        assert all(s.finished and s.error is None for s in running), "streams admitted before go on"
        served = {r.json()["id"]: r.json()["usage"]["completion_tokens"]
                  for rs in during.values() for r in rs if r.status_code == 200}
        served |= {s.request_id: s.received for s in running}
        billed = _wait_events(db, served)
        assert {rid: c for rid, (_p, c, _s) in billed.items()} == served, "kept and written once"
        _reservations_zero(db)
        with db.engine.connect() as conn:
            counts = conn.execute(select(func.count(), func.count(func.distinct(UsageEvent.request_id)))
                                  .select_from(UsageEvent)).one()
        assert counts[0] == counts[1]
    finally:
        proxy.restore() if proxy._listener is None else None
        serve.stop()
    assert not list((data / "usage-journal").glob("*.journal"))
