"""Tenant-fair serving end to end: weights and deadlines reach the engine, a tenant over
its share of the waiting queue gets a 429 naming the reason, and every request has an id
(response header, error body, log lines, usage event).

A server of its own: one running request at a time and a waiting queue of 4 places, of
which a tenant of weight 1 may fill one; real quotas and metering on each backend.
"""
from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import time
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import select

from loraplex.engine.request import Lane
from loraplex.platform.app import create_app
from loraplex.platform.db.database import Database, migrate
from loraplex.platform.db.usage_tables import UsageEvent
from loraplex.platform.observability.json_logs import JsonFormatter
from loraplex.platform.assembly.engine_factory import build_engine
from loraplex.platform.tenancy.tenants import create_key, create_tenant, tenant_info, update_tenant
from tests.e2e.conftest import tiny_engine_config
from tests.e2e.usage_support import FAIL_MAX_TOKENS, ChaosEngine, CountingHooks, Server, metered_settings
from tests.platform.fixtures import BACKENDS, fresh_db_url, pg_schema_url  # noqa: F401 - fixtures


@dataclasses.dataclass
class Fair:
    url: str
    db: Database
    app: object
    engine: object
    chaos: ChaosEngine
    hooks: CountingHooks
    model: str
    keys: dict[str, str]

    def post(self, tenant: str, body: dict, **headers) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/completions", json={"model": self.model, **body}, timeout=60,
                          headers={"authorization": f"Bearer {self.keys[tenant]}", **headers})

    def settle(self) -> None:
        deadline = time.monotonic() + 15
        while self.hooks.open_requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.hooks.metering.writer.flush(15)

    def event(self, request_id: str) -> UsageEvent:
        with self.db.session() as s:
            return s.scalars(select(UsageEvent).where(UsageEvent.request_id == request_id)).one()


@pytest.fixture(scope="module", params=BACKENDS)
def fair(request, tmp_path_factory, base_settings, tiny_llama_dir, pg_schema_url) -> Iterator[Fair]:  # noqa: F811
    url = fresh_db_url(request.param, tmp_path_factory.mktemp("db"), pg_schema_url)
    migrate(url)
    db = Database(url)
    engine_cfg = tiny_engine_config(tiny_llama_dir, max_num_seqs=1, max_waiting=4, tenant_queue_share=0.25)
    settings = metered_settings(dataclasses.replace(base_settings, engine=engine_cfg), url)
    keys = {}
    for name, kw in {"hog": {}, "heavy": {"weight": 3.0}, "quick": {"request_timeout": 0.001},
                     "other": {}}.items():
        create_tenant(db, name, "standard", **kw)
        keys[name] = create_key(db, name)
    engine = build_engine(settings)
    chaos = ChaosEngine(engine)
    hooks = CountingHooks(settings)
    app = create_app(settings, chaos, hooks=hooks)
    with Server(app) as server:
        yield Fair(server.url, db, app, engine, chaos, hooks, settings.model_name, keys)
    engine.shutdown()
    db.dispose()


def test_a_tenant_over_its_queue_share_gets_429_naming_the_reason(fair):
    long = {"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            def send(tenant):
                return client.post(f"{fair.url}/v1/completions", json={"model": fair.model, **long},
                                   headers={"authorization": f"Bearer {fair.keys[tenant]}"})
            running = asyncio.create_task(send("other"))  # holds the only running place
            while (await fair.engine.call(lambda e: e.stats())).running < 1:
                await asyncio.sleep(0.01)
            waiting = asyncio.create_task(send("hog"))  # fills hog's one place in the queue
            while (await fair.engine.call(lambda e: e.stats())).waiting < 1:
                await asyncio.sleep(0.01)
            refused = await send("hog")
            admitted_elsewhere = asyncio.create_task(send("heavy"))  # another tenant still gets in
            return refused, await asyncio.gather(running, waiting, admitted_elsewhere)

    refused, done = asyncio.run(main())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    err = refused.json()["error"]
    assert err["code"] == "tenant_queue_share_exceeded" and err["type"] == "rate_limit_error"
    assert "share of the queue is 1" in err["message"]
    assert err["request_id"] == refused.headers["x-request-id"]
    assert [r.status_code for r in done] == [200, 200, 200]


def test_weights_reach_the_engine_with_each_request(fair):
    heavy = tenant_info(fair.db, "heavy")
    r = fair.post("heavy", {"prompt": [5, 6, 7, 8], "max_tokens": 3, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    before = asyncio.run(fair.engine.call(lambda e: e.scheduler.waiting.counter(Lane.STANDARD, str(heavy.id))))
    r = fair.post("heavy", {"prompt": [9, 10, 11, 12, 13], "max_tokens": 2, "ignore_eos": True,
                            "temperature": 0})
    after = asyncio.run(fair.engine.call(lambda e: e.scheduler.waiting.counter(Lane.STANDARD, str(heavy.id))))
    # The prompt (not cached: different tokens) once, each generated token at weight 2, over weight 3.
    assert after - before == pytest.approx((5 * 1.0 + 2 * 2.0) / 3.0)


def test_a_tenants_request_timeout_ends_it_with_usage_recorded(fair):
    r = fair.post("quick", {"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"  # cut short by the server
    assert body["usage"]["completion_tokens"] < 200
    fair.settle()
    event = fair.event(body["id"])
    assert event.status == "timeout" and event.completion_tokens == body["usage"]["completion_tokens"]
    # Clearing it returns to the server's default (none here): the request runs to its end.
    update_tenant(fair.db, "quick", request_timeout=0)
    time.sleep(0.6)  # the principal cache
    r = fair.post("quick", {"prompt": [5, 6, 7], "max_tokens": 20, "ignore_eos": True, "temperature": 0})
    assert r.json()["usage"]["completion_tokens"] == 20


def test_every_request_has_an_id_in_headers_errors_logs_and_usage(fair):
    r = fair.post("other", {"prompt": [5, 6], "max_tokens": 2}, **{"x-request-id": "client-id-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-id-42"
    made = fair.post("other", {"prompt": [5, 6], "max_tokens": 2})
    assert made.headers["x-request-id"].startswith("req-") and made.headers["x-request-id"] != "client-id-42"
    bad = fair.post("other", {"prompt": [5, 6], "max_tokens": -1}, **{"x-request-id": ("not a sane id " * 20).strip()})
    assert bad.status_code == 400  # an id with spaces (and too long) is replaced by one made here
    assert bad.json()["error"]["request_id"] == bad.headers["x-request-id"] and " " not in bad.headers["x-request-id"]
    fair.settle()
    assert fair.event(r.json()["id"]).correlation_id == "client-id-42"
    assert fair.event(made.json()["id"]).correlation_id == made.headers["x-request-id"]

    # A log line written while the request is handled carries its id (here: the engine
    # failing a streamed request, logged by the gateway).
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logging.getLogger("loraplex").addHandler(handler)
    try:
        with httpx.stream("POST", f"{fair.url}/v1/completions", timeout=60,
                          json={"model": fair.model, "prompt": [5, 6], "max_tokens": FAIL_MAX_TOKENS,
                                "ignore_eos": True, "stream": True},
                          headers={"authorization": f"Bearer {fair.keys['other']}", "x-request-id": "failing-7"}
                          ) as resp:
            text = "".join(resp.iter_text())
    finally:
        logging.getLogger("loraplex").removeHandler(handler)
    assert '"request_id":"failing-7"' in text.replace(" ", "")
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert lines and all(x["request_id"] == "failing-7" for x in lines)


def test_a_request_is_traced_through_every_phase(fair, request):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from loraplex.platform.observability.tracing import Tracing, TracingConfig

    gateway = fair.app.state.gateway
    exporter = InMemorySpanExporter()
    off, gateway.tracing = gateway.tracing, Tracing(TracingConfig(), exporter=exporter)
    request.addfinalizer(lambda: setattr(gateway, "tracing", off))
    assert not off.enabled  # no --otlp-endpoint: tracing is off
    r = fair.post("other", {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "stream": True},
                  **{"x-request-id": "traced-1"})
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    while len(exporter.get_finished_spans()) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"request", "admission", "queue", "prefill", "decode", "metering"}
    root = spans.pop("request")
    assert root.attributes["loraplex.request_id"] == "traced-1"
    assert root.attributes["loraplex.finish_reason"] == "length" and root.attributes["loraplex.output_tokens"] == 4
    assert all(s.parent.span_id == root.context.span_id for s in spans.values())
    assert spans["queue"].end_time <= spans["prefill"].end_time <= spans["decode"].end_time
