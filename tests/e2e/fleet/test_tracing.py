"""One trace across the gateway → worker hop, as real processes: a `loraplex gateway` and a
`loraplex worker` exporting to one loopback OTLP collector. The worker's `request` span
is a child of the gateway's, and a client's `traceparent` keeps its trace id through both."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraplex.platform.db.database import Database, migrate
from loraplex.platform.tenancy.tenants import create_key, create_tenant
from tests.e2e.fleet import processes as P
from tests.helpers.otlp import OtlpCollector, Span

CLIENT_TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


def _tenant_key(url: str) -> str:
    migrate(url)
    db = Database(url)
    try:
        create_tenant(db, "acme")
        return create_key(db, "acme")
    finally:
        db.dispose()


def _complete(gateway: P.Proc, key: str, request_id: str, **headers: str) -> None:
    with httpx.Client(base_url=gateway.url, timeout=120) as http:
        model = http.get("/v1/models", headers={"authorization": f"Bearer {key}"}).json()["data"][0]["id"]
        resp = http.post("/v1/completions", json={"model": model, "prompt": "trace me", "max_tokens": 3},
                         headers={"authorization": f"Bearer {key}", "x-request-id": request_id, **headers})
        assert resp.status_code == 200, resp.text


@pytest.fixture(scope="module")
def spans(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Span]]:
    """What the gateway and the worker exported for two requests: `plain` (no trace
    context sent) and `continued` (the client's traceparent)."""
    logs = tmp_path_factory.mktemp("traced")
    url = f"sqlite:///{logs / 'gateway.db'}"
    key = _tenant_key(url)
    collector = OtlpCollector()
    otlp = ("--otlp-endpoint", collector.endpoint)
    worker = P.worker(tiny_llama_dir, url, logs, "worker", "--max-model-len", "256", "--num-kv-blocks", "64", *otlp)
    gateway = P.gateway([worker], url, logs, "gateway", *otlp)
    try:
        worker.start().wait_ready()
        gateway.start().wait_ready()
        _complete(gateway, key, "plain")
        _complete(gateway, key, "continued", traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
    finally:
        gateway.stop()  # SIGTERM: each exports the spans it still buffers before it exits
        worker.stop()
        collector.close()
    yield collector.spans()


def _request_spans(spans: list[Span], request_id: str) -> tuple[Span, Span]:
    """(the gateway's `request` span, the worker's) of one request."""
    def one(service: str) -> Span:
        found = [s for s in spans if s.name == "request" and s.service == service
                 and s.attributes.get("loraplex.request_id") == request_id]
        assert len(found) == 1, (service, request_id, spans)
        return found[0]

    return one("loraplex-gateway"), one("loraplex-worker")


def test_the_workers_request_span_is_a_child_of_the_gateways(spans):
    gw, worker = _request_spans(spans, "plain")
    assert gw.parent_span_id == ""  # the client sent no trace context: the gateway's is the root
    assert (worker.trace_id, worker.parent_span_id) == (gw.trace_id, gw.span_id)


def test_a_clients_traceparent_continues_through_gateway_and_worker(spans):
    gw, worker = _request_spans(spans, "continued")
    assert (gw.trace_id, gw.parent_span_id) == (CLIENT_TRACE, CLIENT_SPAN)
    assert (worker.trace_id, worker.parent_span_id) == (CLIENT_TRACE, gw.span_id)
