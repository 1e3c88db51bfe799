"""Two gateway PROCESSES on one PostgreSQL enforce ONE rpm / tpm / concurrency limit:
admitted <= limit, not limit x 2. (PostgreSQL only: it is how replicas share state.)"""
from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from loraplex.platform.db.database import Database, migrate
from loraplex.platform.quotas.limits import set_quota
from loraplex.platform.tenancy.tenants import create_key, create_tenant

from tests.e2e.usage_support import counters, export_events
from tests.platform.fixtures import pg_schema_url  # noqa: F401 - fixture

REPO = Path(__file__).resolve().parents[2]
DELAY = 0.01  # per streamed output: a 100-token request stays in flight for over a second


@pytest.fixture(scope="module")
def replicas(pg_schema_url, tiny_llama_dir, tmp_path_factory) -> Iterator[tuple[Database, list[str]]]:  # noqa: F811
    url = pg_schema_url()
    migrate(url)
    db = Database(url)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.e2e.replica_server", "--database-url", url,
                               "--model-dir", str(tiny_llama_dir), "--data-dir", str(tmp_path_factory.mktemp("rep")),
                               "--delay", str(DELAY)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}) for _ in range(2)]
    try:
        urls = []
        for p in procs:
            line = p.stdout.readline()  # blocks until the replica serves (or dies)
            assert line.startswith("PORT "), f"replica failed to start: {line!r}"
            urls.append(f"http://127.0.0.1:{int(line.split()[1])}/v1")
        for u in urls:  # wait until accepting
            deadline = time.monotonic() + 60
            while True:
                try:
                    openai.OpenAI(base_url=u, api_key="x", max_retries=0, timeout=2).models.list()
                except openai.AuthenticationError:
                    break
                except openai.APIConnectionError:
                    assert time.monotonic() < deadline, "replica not answering"
                    time.sleep(0.1)
        yield db, urls
    finally:
        for p in procs:
            p.terminate()  # SIGTERM: graceful shutdown, usage flushed
        for p in procs:
            try:
                assert p.wait(60) in (0, -15)  # uvicorn re-raises the signal once shut down
            except subprocess.TimeoutExpired:
                p.kill()
                raise
        db.dispose()


def _tenant(db: Database, **limits) -> tuple[str, str]:
    name = f"rep-{uuid.uuid4().hex[:6]}"
    create_tenant(db, name)
    set_quota(db, name, **limits)
    return name, create_key(db, name)


def _burst(urls: list[str], key: str, n: int, **create) -> list[int]:
    """n requests at once, alternating replicas; their HTTP statuses."""
    barrier = threading.Barrier(n)
    statuses: list[int] = []

    def one(i: int) -> None:
        client = openai.OpenAI(base_url=urls[i % 2], api_key=key, max_retries=0, timeout=60)
        barrier.wait()
        try:
            client.completions.create(model="", prompt="x", temperature=0, extra_body={"ignore_eos": True}, **create)
            statuses.append(200)
        except openai.RateLimitError:
            statuses.append(429)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


def _same_minute(seconds_needed: float = 5.0) -> None:
    if time.time() % 60 > 60 - seconds_needed:
        time.sleep(60 - time.time() % 60 + 0.2)


def test_one_rpm_limit(replicas):
    db, urls = replicas
    _, key = _tenant(db, rpm=6)
    _same_minute()
    statuses = _burst(urls, key, 20, max_tokens=1)
    assert statuses.count(200) == 6 and statuses.count(429) == 14


def test_one_tpm_limit(replicas, tiny_engine):
    db, urls = replicas
    per = len(tiny_engine.tokenizer.encode("x")) + 10
    tpm = 5 * per + per // 2
    name, key = _tenant(db, tpm=tpm)
    _same_minute()
    statuses = _burst(urls, key, 16, max_tokens=10)
    assert statuses.count(200) == 5
    time.sleep(0.5)  # the replicas' writers flush every 20 ms
    events = export_events(db, name)
    assert len(events) == 5 and sum(e["total_tokens"] for e in events) <= tpm


def test_one_concurrency_limit(replicas):
    db, urls = replicas
    name, key = _tenant(db, max_concurrency=3)
    statuses = _burst(urls, key, 12, max_tokens=100, stream=False)
    assert statuses.count(200) == 3 and statuses.count(429) == 9
    deadline = time.monotonic() + 10
    while len(events := export_events(db, name)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    # At no instant were more than 3 in flight (from the events' own timestamps).
    edges = sorted([(dt.datetime.fromisoformat(e["received_at"]), 1) for e in events]
                   + [(dt.datetime.fromisoformat(e["finished_at"]), -1) for e in events])
    level = peak = 0
    for _, d in edges:
        level += d
        peak = max(peak, level)
    assert len(events) == 3 and peak <= 3
    assert counters(db, name)["in_flight"] == 0 and counters(db, name)["live_leases"] == 0
