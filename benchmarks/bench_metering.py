"""Metering costs, on SQLite and PostgreSQL, in one run:

  1. usage events written per second through the batched writer (UsageWriter: batches,
     idempotent insert + rollup upsert in one transaction) vs a naive baseline that
     writes each event in its own transaction (same statements, batch of one);
  2. a one-month per-tenant usage query over --query-events events (default 1M, 30 days,
     100 tenants, one big tenant with half of them): from the hourly rollups vs from the
     raw events;
  3. gateway CPU per request (HTTP, one-token completions, tiny model) for a tenant without
     limits and one with all four limits (rpm, tpm, concurrency, budget), counting every
     thread of the process except the engine's and the benchmark client's (the event loop,
     the DB worker threads, the usage writer).

    python benchmarks/bench_metering.py                       # everything, both databases
    python benchmarks/bench_metering.py --query-events 200000 --backends sqlite
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import random
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from loraplex.platform.db.database import Database, make_db_engine, migrate
from loraplex.platform.metering.writer import Event, EventStore, UsageWriter
from loraplex.platform.tenancy.tenants import create_tenant
from loraplex.platform.metering.usage import usage_summary, usage_totals_raw

PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
MONTH = 30 * 86400


def fresh_url(backend: str, tmp: Path) -> tuple[str, str | None]:
    if backend == "sqlite":
        return f"sqlite:///{tmp / f'bench-{uuid.uuid4().hex[:8]}.db'}", None
    import psycopg

    schema = f"bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    return f"{PG}?options=-csearch_path%3D{schema}", schema


def drop_schema(schema: str | None) -> None:
    if schema:
        import psycopg

        with psycopg.connect(PG.replace("+psycopg", ""), autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def make_events(n: int, tenants: list[int], start: float, span: float, seed: int = 0) -> list[Event]:
    rnd = random.Random(seed)
    big = tenants[0]
    out = []
    for i in range(n):
        t = big if rnd.random() < 0.5 else rnd.choice(tenants)
        fin = start + rnd.random() * span
        adapter = rnd.choice((None, None, "sql-helper", "chat-tuned"))
        out.append(Event(f"bench-{uuid.uuid4().hex}", t, t * 10, adapter, "sha256:" + "ab" * 32 if adapter else None,
                         rnd.randrange(3), "length", rnd.randrange(5, 400), rnd.randrange(0, 64),
                         rnd.randrange(1, 300), fin - 2.0, fin - 1.5, fin))
    return out


# -- 1. write throughput --------------------------------------------------------------------
def bench_writes(url: str, n_batched: int, n_naive: int, tenants: list[int]) -> dict:
    engine = make_db_engine(url, pre_ping=False)
    try:
        now = time.time()
        events = make_events(n_batched, tenants, now - 3600, 3600, seed=1)
        w = UsageWriter(engine, flush_interval=0.01)
        w.start()
        t0 = time.perf_counter()
        for e in events:
            w.submit(e)
        assert w.flush(timeout=600)
        batched = n_batched / (time.perf_counter() - t0)
        w.close()
        naive_events = make_events(n_naive, tenants, now - 3600, 3600, seed=2)
        store = EventStore(engine)
        t0 = time.perf_counter()
        for e in naive_events:
            store.write([e])
        naive = n_naive / (time.perf_counter() - t0)
        return {"batched": batched, "naive": naive}
    finally:
        engine.dispose()


# -- 1b. durable acknowledgements (the usage journal) ----------------------------------------
def bench_journal(url: str, tmp: Path, n: int, concurrency: int, tenants: list[int]) -> dict:
    """Requests finishing on one event loop, `concurrency` at a time: each finish either
    queues its event in memory (the writer alone, lost on a crash) or journals it and waits
    for its group-committed fsync (ledger + journal, what the gateway does), both drained
    to the database by the same writer. Also the per-token checkpoint test's cost."""
    from loraplex.platform.metering.journal import Journal
    from loraplex.platform.metering.ledger import JournalConfig, Ledger

    engine = make_db_engine(url, pre_ping=False)
    now = time.time()
    out = {}
    try:
        for mode in ("memory", "journal"):
            events = make_events(n, tenants, now - 3600, 3600, seed=3 if mode == "memory" else 4)
            journal = Journal(tmp / f"journal-{uuid.uuid4().hex[:6]}", "bench") if mode == "journal" else None
            w = UsageWriter(engine, flush_interval=0.01, journal=journal)
            ledger = Ledger(journal, w, lambda res, used: None, JournalConfig(tmp)) if journal else None
            w.start()

            async def finisher(mine: list[Event]) -> None:
                for e in mine:
                    if ledger is None:
                        w.submit(e)
                        await asyncio.sleep(0)
                    else:
                        lsn, _seg = ledger.finish(e, None)
                        await journal.durable(lsn)

            async def run() -> float:
                t0 = time.perf_counter()
                await asyncio.gather(*(finisher(events[i::concurrency]) for i in range(concurrency)))
                return time.perf_counter() - t0

            out[mode] = n / asyncio.run(run())
            assert w.flush(timeout=600)
            w.close()
            if journal is not None:
                out["fsyncs_per_event"] = journal.fsyncs / n
                journal.close()
                t0 = time.perf_counter()
                for i in range(100_000):
                    ledger.due("r", i, 0.5)
                out["due_ns"] = (time.perf_counter() - t0) / 100_000 * 1e9
        return out
    finally:
        engine.dispose()


# -- 2. the month query -----------------------------------------------------------------------
def load_events(url: str, n: int, tenants: list[int], start: float) -> float:
    engine = make_db_engine(url, pre_ping=False)
    store = EventStore(engine)
    chunk = 5000
    t0 = time.perf_counter()
    try:
        for i in range(0, n, chunk):
            store.write(make_events(min(chunk, n - i), tenants, start, MONTH, seed=100 + i))
    finally:
        engine.dispose()
    return n / (time.perf_counter() - t0)


def timed(fn, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_query(db: Database, tenants: list[int], names: dict[int, str], start: float) -> dict:
    a = dt.datetime.fromtimestamp(start, dt.timezone.utc)
    b = a + dt.timedelta(seconds=MONTH)
    out = {}
    for label, tid in (("big tenant", tenants[0]), ("small tenant", tenants[1])):
        rollup_total = timed(lambda: usage_summary(db, a, b, tenant=names[tid], granularity="total"))
        rollup_daily = timed(lambda: usage_summary(db, a, b, tenant=names[tid], granularity="day"))
        raw = timed(lambda: usage_totals_raw(db, a, b, tid), repeat=3)
        rows = usage_summary(db, a, b, tenant=names[tid], granularity="total", by_adapter=False)[0]
        check = usage_totals_raw(db, a, b, tid)
        assert rows.requests == check["requests"] and rows.completion_tokens == check["completion_tokens"]
        out[label] = {"events": check["requests"], "rollup_total_ms": rollup_total * 1e3,
                      "rollup_daily_ms": rollup_daily * 1e3, "raw_total_ms": raw * 1e3}
    return out


# -- 3. gateway CPU per request ----------------------------------------------------------------
def bench_gateway_cpu(url: str, tmp: Path, requests: int, concurrency: int) -> dict:
    import torch
    from bench_gateway import RawClient, model_dir, start_server
    from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig
    from loraplex.platform.assembly.engine_factory import build_engine
    from loraplex.platform.quotas.limits import set_quota
    from loraplex.platform.settings import AuthConfig, Settings
    from loraplex.platform.tenancy.tenants import create_key

    torch.set_num_threads(1)
    config = EngineConfig(model=ModelConfig(model=model_dir("tiny", tmp), dtype="float32", max_model_len=512),
                          cache=CacheConfig(num_blocks=256), num_threads=1)
    settings = Settings(engine=config, data_dir=tmp / "data", database_url=url,
                        auth=AuthConfig(last_used_flush_seconds=5))
    db = Database(url)
    keys = {}
    for label, limits in (("no limits", {}), ("all four limits", dict(rpm=10**7, tpm=10**9, max_concurrency=1000,
                                                                      token_budget=10**12, budget_period="month"))):
        name = f"cpu-{uuid.uuid4().hex[:6]}"
        create_tenant(db, name)
        if limits:
            set_quota(db, name, **limits)
        keys[label] = create_key(db, name)
    engine = build_engine(settings)
    server, server_thread, port = start_server(settings, engine)
    out = {}
    try:
        for label, key in keys.items():
            RawClient(port, key, settings.model_name).one()  # warm: caches, connections
            samples = []
            for _ in range(3):
                client_cpu = [0.0]
                lock = threading.Lock()

                def run(c: RawClient, k: int) -> None:
                    t0 = time.thread_time()
                    for _ in range(k):
                        c.one()
                    with lock:
                        client_cpu[0] += time.thread_time() - t0

                clients = [RawClient(port, key, settings.model_name) for _ in range(concurrency)]
                per = requests // concurrency
                threads = [threading.Thread(target=run, args=(c, per)) for c in clients]
                eng_thread = engine._thread
                e0 = time.clock_gettime(time.pthread_getcpuclockid(eng_thread.ident))
                p0 = time.process_time()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                server.config.app.state.usage.metering.writer.flush()
                p1 = time.process_time()
                e1 = time.clock_gettime(time.pthread_getcpuclockid(eng_thread.ident))
                samples.append((p1 - p0 - (e1 - e0) - client_cpu[0]) / (per * concurrency) * 1e3)
            samples.sort()
            out[label] = samples[len(samples) // 2]
    finally:
        server.should_exit = True
        server_thread.join(30)
        engine.shutdown()
        db.dispose()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--events", type=int, default=20_000, help="events through the batched writer")
    ap.add_argument("--naive", type=int, default=2_000, help="events written one transaction each")
    ap.add_argument("--query-events", type=int, default=1_000_000)
    ap.add_argument("--tenants", type=int, default=100)
    ap.add_argument("--requests", type=int, default=400, help="HTTP requests per gateway CPU sample")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--journal-events", type=int, default=20_000, help="finishes through the usage journal")
    ap.add_argument("--journal-concurrency", type=int, default=64)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: writes,journal,query,gateway")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    tmp = Path(tempfile.mkdtemp(prefix="bench_metering_"))
    start = time.time() // 86400 * 86400 - MONTH
    for backend in args.backends.split(","):
        print(f"== {backend}")
        url, schema = fresh_url(backend, tmp)
        try:
            migrate(url)
            db = Database(url)
            tenants = [create_tenant(db, f"t{i:03d}").id for i in range(args.tenants)]
            names = {tid: f"t{i:03d}" for i, tid in enumerate(tenants)}
            if "writes" not in skip:
                r = bench_writes(url, args.events, args.naive, tenants)
                print(f"  usage events written/s: batched writer {r['batched']:10,.0f}   naive (1 tx/event) "
                      f"{r['naive']:8,.0f}   ratio {r['batched'] / r['naive']:.1f}x")
            if "journal" not in skip:
                j = bench_journal(url, tmp, args.journal_events, args.journal_concurrency, tenants)
                print(f"  finishes acknowledged/s ({args.journal_concurrency} at a time): journalled + fsync'd "
                      f"{j['journal']:10,.0f}   in memory (no durability) {j['memory']:10,.0f}   ratio "
                      f"{j['journal'] / j['memory']:.2f}x   fsyncs per event {j['fsyncs_per_event']:.3f}   "
                      f"checkpoint test per token {j['due_ns']:.0f} ns")
            if "query" not in skip:
                rate = load_events(url, args.query_events, tenants, start)
                print(f"  loaded {args.query_events:,} events over 30 days in 5000-event batches: {rate:,.0f} events/s")
                for label, q in bench_query(db, tenants, names, start).items():
                    print(f"  one-month query, {label} ({q['events']:,} events): rollups total "
                          f"{q['rollup_total_ms']:7.2f} ms, per day {q['rollup_daily_ms']:7.2f} ms   raw events "
                          f"{q['raw_total_ms']:8.2f} ms   ({q['raw_total_ms'] / q['rollup_total_ms']:.0f}x)")
            db.dispose()
            if "gateway" not in skip:
                g = bench_gateway_cpu(url, tmp, args.requests, args.concurrency)
                print("  gateway CPU per request (auth + quotas + metering + HTTP + JSON, engine excluded): "
                      + ", ".join(f"{k} {v:.3f} ms" for k, v in g.items()))
        finally:
            drop_schema(schema)


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
