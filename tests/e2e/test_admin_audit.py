"""The audit log on a live server (SQLite and PostgreSQL): bursts of failed sign-ins and
wrong Bearer tokens from many addresses become two rows per window (its first failure and
the count of the rest), not one row each, and so do the attempts refused (429) while an
address is throttled; billing exports are recorded. How windows follow one another:
tests/platform/admin/test_failed_auth.py."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import httpx
import pytest

from loraplex.platform.app import create_app
from loraplex.platform.db.database import Database, migrate
from loraplex.platform.settings import AdminConfig, Settings
from loraplex.platform.tenancy.audit import entries
from tests.e2e.admin_fixtures import ADMIN_TOKEN
from tests.e2e.conftest import LiveServer
from tests.platform.fixtures import BACKENDS, fresh_db_url

# Seconds of failures per aggregated row (the default): far longer than a burst takes,
# however busy the machine. A server's window ends when it shuts down.
WINDOW = 60.0
BURST = 30


@pytest.fixture(scope="module", params=BACKENDS)
def settings(request, tmp_path_factory, base_settings, pg_schema_url) -> Settings:
    url = fresh_db_url(request.param, tmp_path_factory.mktemp("audit_db"), pg_schema_url)
    migrate(url)
    return dataclasses.replace(base_settings, database_url=url,
                               admin=AdminConfig(token=ADMIN_TOKEN, audit_failure_window=WINDOW),
                               auth=dataclasses.replace(base_settings.auth, failure_burst=100_000))


@pytest.fixture(scope="module")
def server(settings, tiny_engine) -> Iterator[str]:
    with LiveServer(create_app(settings, tiny_engine)) as live:
        yield live.url


def _audit(url: str, action: str) -> list[dict]:
    r = httpx.get(f"{url}/admin/api/audit", params={"action": action, "limit": 1000},
                  headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_for_rows(url: str, action: str, n: int, timeout: float = 60.0) -> list[dict]:
    """The audit rows of `action` once there are `n` (the window's row comes when it ends)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = _audit(url, action)
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def _burst(url: str, send, addresses: range) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        for i in addresses:
            r = send(http, {"x-forwarded-for": f"203.0.113.{i}"})
            assert r.status_code == 401, r.text


# A failed sign-in, and a request with a wrong Bearer token, by the action audited for it.
FAILURES = [
    ("session.failed", lambda http, h: http.post("/admin/api/session", json={"token": "wrong-" + ADMIN_TOKEN},
                                                 headers=h)),
    ("admin.bearer_failed", lambda http, h: http.get("/admin/api/tenants",
                                                     headers={**h, "authorization": "Bearer not-the-token"})),
]


@pytest.mark.parametrize("action, send", FAILURES)
def test_a_burst_of_failures_from_many_addresses_is_two_rows(settings, server, tiny_engine, action, send):
    # A server of its own: its window ends when it stops, not when the module's does.
    with LiveServer(create_app(settings, tiny_engine)) as live:
        _burst(live.url, send, range(1, 2))
        (first,) = _wait_for_rows(live.url, action, 1)  # the window's first failure: a row at once
        _burst(live.url, send, range(2, BURST + 1))
        assert _audit(live.url, action) == [first], "the rest waits for the window's end"
    rows = _audit(server, action)  # the same database
    assert len(rows) == 2, rows
    aggregate, first = rows  # newest first
    assert first["actor"] == "anonymous" and first["target"] == "client:203.0.113.1" and first["details"]["reason"]
    d = aggregate["details"]
    assert aggregate["target"] == f"clients:{BURST - 1}"
    assert d["count"] == BURST - 1 and d["distinct_clients"] == BURST - 1 and len(d["clients"]) == 10
    assert set(d["clients"]) <= {f"203.0.113.{i}" for i in range(2, BURST + 1)} and d["window_seconds"] == WINDOW


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("action, send", FAILURES)
def test_attempts_refused_while_throttled_are_counted_in_the_window(base_settings, tiny_engine, tmp_path,
                                                                     pg_schema_url, backend, action, send):
    # A database of its own: the module's holds the other tests' rows of the same actions.
    url = fresh_db_url(backend, tmp_path, pg_schema_url)
    migrate(url)
    allowed = 3  # failures before the address is throttled; its allowance never comes back here
    settings = dataclasses.replace(base_settings, database_url=url,
                                   admin=AdminConfig(token=ADMIN_TOKEN, audit_failure_window=WINDOW),
                                   auth=dataclasses.replace(base_settings.auth, failure_burst=allowed,
                                                            failure_rate=1e-9))
    with LiveServer(create_app(settings, tiny_engine)) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        statuses = [send(http, {"x-forwarded-for": "203.0.113.7"}).status_code for _ in range(BURST)]
    assert statuses == [401] * allowed + [429] * (BURST - allowed)
    db = Database(url)  # the server has stopped: its window's row is written
    try:
        with db.session() as s:
            rows = [(e.actor, e.target, e.details) for e in entries(s, action=action, limit=1000)]
    finally:
        db.dispose()
    assert len(rows) == 2, rows  # the window's first failure and one row for the rest, not one per attempt
    (actor, target, d), (_, first_target, first) = rows  # newest first
    assert first_target == target == "client:203.0.113.7" and first["reason"] and actor == "anonymous"
    assert d["count"] == BURST - 1 and d["throttled"] == BURST - allowed, d
    assert d["distinct_clients"] == 1 and d["reason"].startswith("too many failed"), d


def test_billing_exports_are_audited(server):
    r = httpx.get(f"{server}/admin/api/usage/export", params={"format": "jsonl", "granularity": "day"},
                  headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60)
    assert r.status_code == 200, r.text
    (row,) = _audit(server, "usage.export")
    assert row["actor"].startswith("token:") and row["target"] == "usage"
    assert row["details"]["format"] == "jsonl" and row["details"]["granularity"] == "day"
    assert row["details"]["start"] < row["details"]["end"]
