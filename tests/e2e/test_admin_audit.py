"""The audit log on a live server (SQLite and PostgreSQL): bursts of failed sign-ins and
wrong Bearer tokens from many addresses become one row per window, not one row each;
billing exports are recorded."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import httpx
import pytest

from loraplex.platform.app import create_app
from loraplex.platform.db.database import migrate
from loraplex.platform.settings import AdminConfig
from tests.e2e.admin_fixtures import ADMIN_TOKEN
from tests.e2e.conftest import LiveServer
from tests.platform.fixtures import BACKENDS, fresh_db_url

WINDOW = 1.0  # seconds of failures per aggregated row (60 by default)
BURST = 30


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, tmp_path_factory, base_settings, tiny_engine, pg_schema_url) -> Iterator[str]:
    url = fresh_db_url(request.param, tmp_path_factory.mktemp("audit_db"), pg_schema_url)
    migrate(url)
    settings = dataclasses.replace(base_settings, database_url=url,
                                   admin=AdminConfig(token=ADMIN_TOKEN, audit_failure_window=WINDOW),
                                   auth=dataclasses.replace(base_settings.auth, failure_burst=100_000))
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


def _burst(url: str, send) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        for i in range(BURST):
            r = send(http, {"x-forwarded-for": f"203.0.113.{i + 1}"})
            assert r.status_code == 401, r.text


@pytest.mark.parametrize("action, send", [
    ("session.failed", lambda http, h: http.post("/admin/api/session", json={"token": "wrong-" + ADMIN_TOKEN},
                                                 headers=h)),
    ("admin.bearer_failed", lambda http, h: http.get("/admin/api/tenants",
                                                     headers={**h, "authorization": "Bearer not-the-token"})),
])
def test_a_burst_of_failures_from_many_addresses_is_two_rows(server, action, send):
    _burst(server, send)
    rows = _wait_for_rows(server, action, 2)
    assert len(rows) == 2, rows
    aggregate, first = rows  # newest first
    assert first["actor"] == "anonymous" and first["target"] == "client:203.0.113.1" and first["details"]["reason"]
    d = aggregate["details"]
    assert aggregate["target"] == f"clients:{BURST - 1}"
    assert d["count"] == BURST - 1 and d["distinct_clients"] == BURST - 1 and len(d["clients"]) == 10
    assert set(d["clients"]) <= {f"203.0.113.{i}" for i in range(2, BURST + 1)} and d["window_seconds"] == WINDOW
    # A later lone failure opens a window of its own: visible at once.
    with httpx.Client(base_url=server, timeout=60) as http:
        assert send(http, {"x-forwarded-for": "198.51.100.7"}).status_code == 401
    rows = _wait_for_rows(server, action, 3)
    assert rows[0]["target"] == "client:198.51.100.7"


def test_billing_exports_are_audited(server):
    r = httpx.get(f"{server}/admin/api/usage/export", params={"format": "jsonl", "granularity": "day"},
                  headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60)
    assert r.status_code == 200, r.text
    (row,) = _audit(server, "usage.export")
    assert row["actor"].startswith("token:") and row["target"] == "usage"
    assert row["details"]["format"] == "jsonl" and row["details"]["granularity"] == "day"
    assert row["details"]["start"] < row["details"]["end"]
