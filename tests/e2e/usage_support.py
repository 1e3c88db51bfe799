"""Support for the quota/metering end-to-end tests: an engine wrapper that can slow
streams down and fail requests, hooks that count admissions and finishes, a live server
with real quotas and metering per database backend, and export helpers."""
from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import aclosing
from dataclasses import dataclass

import openai
import pytest
import uvicorn
from loraplex.platform.app import create_app
from loraplex.platform.db.database import Database, migrate
from loraplex.platform.quotas.limits import quota_status, set_quota
from loraplex.platform.tenancy.tenants import create_key, create_tenant
from loraplex.platform.metering.usage import export_usage
from loraplex.platform.assembly.usage_hooks import UsageHooks
from loraplex.platform.db.usage_tables import QuotaLease
from loraplex.platform.settings import QuotaConfig, UsageConfig
from sqlalchemy import func, select

from tests.platform.fixtures import BACKENDS, fresh_db_url, pg_schema_url  # noqa: F401 - fixtures

FAIL_MAX_TOKENS = 97  # ChaosEngine fails requests with this max_tokens after 3 outputs


class ChaosEngine:
    """An AsyncEngine with an optional delay before each output (slow streams), and an
    injected failure for requests with max_tokens == FAIL_MAX_TOKENS."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.delay = 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, prompt, sampling=None, **kw):
        stream = self.inner.generate(prompt, sampling, **kw)
        n = 0
        async with aclosing(stream):
            async for out in stream:
                if self.delay:
                    await asyncio.sleep(self.delay)
                n += 1
                if sampling is not None and sampling.max_tokens == FAIL_MAX_TOKENS and n > 3:
                    raise RuntimeError("injected engine failure")
                yield out


class CountingHooks(UsageHooks):
    """The real hooks, counting admit/finish per request id."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.admits: Counter[str] = Counter()
        self.finishes: Counter[str] = Counter()
        self.tenant_of: dict[str, str] = {}

    async def admit(self, ctx) -> None:
        await super().admit(ctx)
        self.admits[ctx.request_id] += 1
        self.tenant_of[ctx.request_id] = ctx.principal.tenant

    def admitted(self, tenant: str) -> set[str]:
        return {rid for rid, t in self.tenant_of.items() if t == tenant}

    async def finish(self, ctx) -> None:
        self.finishes[ctx.request_id] += 1
        await super().finish(ctx)


class Server:
    """uvicorn in a thread on a free port (like conftest.LiveServer, with a chosen
    graceful-shutdown timeout)."""

    def __init__(self, app, graceful: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=graceful))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()

    def __exit__(self, *exc) -> None:
        self.stop()


def metered_settings(base, url: str, **kw):
    """The e2e settings (same data dir: the engine's adapter store) on database `url`,
    with quota changes applying within 50 ms and usage written every 20 ms."""
    return dataclasses.replace(base, database_url=url, quotas=QuotaConfig(cache_ttl=0.05),
                               usage=UsageConfig(flush_seconds=0.02), **kw)


@dataclass
class Metered:
    backend: str
    url: str
    model: str
    db: Database
    settings: object
    app: object
    engine: ChaosEngine
    hooks: CountingHooks

    def tenant(self, prefix: str, **limits) -> tuple[str, str]:
        """A fresh tenant with these limits, and a key: (name, key)."""
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        create_tenant(self.db, name, "interactive")
        if limits:
            set_quota(self.db, name, **limits)
        return name, create_key(self.db, name)

    def client(self, key: str, base: str = "/v1", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}{base}", api_key=key, **{"max_retries": 0, "timeout": 60, **kw})

    def async_client(self, key: str, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60, **kw)

    def settle(self, timeout: float = 15.0) -> None:
        """Wait until every admitted request has finished and its usage is written."""
        deadline = time.monotonic() + timeout
        while self.hooks.open_requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.hooks.open_requests == 0, "requests still open"
        assert self.hooks.metering.writer.flush(timeout), "usage events not written"

    def events(self, tenant: str) -> list[dict]:
        return export_events(self.db, tenant)


def export_events(db: Database, tenant: str | None = None, fmt: str = "jsonl") -> list[dict]:
    now = dt.datetime.now(dt.timezone.utc)
    start = (now - dt.timedelta(days=1)).replace(minute=0, second=0, microsecond=0)
    end = (now + dt.timedelta(hours=2)).replace(minute=0, second=0, microsecond=0)
    return [json.loads(x) for x in b"".join(export_usage(db, start, end, fmt=fmt, tenant=tenant)).splitlines()]


def export_range() -> tuple[dt.datetime, dt.datetime]:
    now = dt.datetime.now(dt.timezone.utc)
    return ((now - dt.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0),
            (now + dt.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0))


def counters(db: Database, tenant: str) -> dict:
    """The tenant's quota state: in flight, budget used, tpm used (all windows), live leases."""
    from loraplex.platform.quotas.limits import tenant_scope
    from loraplex.platform.tenancy.tenants import tenant_info
    from loraplex.platform.db.usage_tables import QuotaCounter

    st = quota_status(db, tenant)
    tid = tenant_info(db, tenant).id
    with db.engine.connect() as conn:
        tpm = conn.execute(select(func.coalesce(func.sum(QuotaCounter.used), 0)).where(
            QuotaCounter.scope == tenant_scope(tid), QuotaCounter.kind == "tpm")).scalar()
        leases = conn.execute(select(func.count()).select_from(QuotaLease).where(QuotaLease.state == "live")).scalar()
    return {"in_flight": st.in_flight, "budget_used": st.budget_used, "tpm_used": int(tpm), "live_leases": leases}


@pytest.fixture(scope="module", params=BACKENDS)
def metered(request, tmp_path_factory, base_settings, tiny_engine, pg_schema_url) -> Iterator[Metered]:  # noqa: F811
    """A live server with the real quota/metering hooks (counting), on a fresh database."""
    url = fresh_db_url(request.param, tmp_path_factory.mktemp("db"), pg_schema_url)
    migrate(url)
    db = Database(url)
    settings = metered_settings(base_settings, url)
    chaos = ChaosEngine(tiny_engine)
    hooks = CountingHooks(settings)
    app = create_app(settings, chaos, hooks=hooks)
    with Server(app) as server:
        yield Metered(request.param, server.url, settings.model_name, db, settings, app, chaos, hooks)
    db.dispose()
