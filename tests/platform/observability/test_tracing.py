from __future__ import annotations

import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from loraplex.platform.observability.request_id import bind_request_id
from loraplex.platform.observability.tracing import (
    TraceContextMiddleware,
    Tracing,
    TracingConfig,
    inject_trace_context,
)

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def test_off_by_default_every_helper_is_one_shared_null_context():
    t = Tracing(TracingConfig())
    assert not t.enabled
    assert t.request_span() is t.span("admission") is t.span("metering", x=1)
    with t.request_span() as span:
        assert span is None
    t.record_phases(0.0, 1.0, 2.0, 3.0)
    t.shutdown()


def request(t: Tracing) -> None:
    now = time.monotonic()
    with bind_request_id("req-7"), t.request_span(lane="interactive", adapter="sql"):
        with t.span("admission"):
            pass
        t.record_phases(now - 3.0, now - 2.5, now - 2.0, now - 0.5, prompt_tokens=12)
        with t.span("metering", tokens=20):
            pass


def test_a_request_becomes_a_tree_of_phase_spans():
    exporter = InMemorySpanExporter()
    t = Tracing(TracingConfig(), exporter=exporter)
    request(t)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"request", "admission", "queue", "prefill", "decode", "metering"}
    root = spans.pop("request")
    assert root.attributes["loraplex.lane"] == "interactive" and root.attributes["loraplex.request_id"] == "req-7"
    for s in spans.values():
        assert s.parent.span_id == root.context.span_id and s.context.trace_id == root.context.trace_id
        assert s.attributes["loraplex.request_id"] == "req-7"
    q, p, d = spans["queue"], spans["prefill"], spans["decode"]
    assert q.end_time == p.start_time and p.end_time == d.start_time
    assert (q.end_time - q.start_time, p.end_time - p.start_time, d.end_time - d.start_time) == \
        pytest.approx((0.5e9, 0.5e9, 1.5e9), abs=1e6)
    assert spans["metering"].attributes["loraplex.tokens"] == 20


def test_phases_that_never_began_are_left_out():
    exporter = InMemorySpanExporter()
    t = Tracing(TracingConfig(), exporter=exporter)
    t.record_phases(1.0, None, None, 2.0)
    assert [s.name for s in exporter.get_finished_spans()] == ["queue"]


class _Collector(BaseHTTPRequestHandler):
    bodies: list[tuple[str, bytes]] = []

    def do_POST(self):
        self.bodies.append((self.path, self.rfile.read(int(self.headers["content-length"]))))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_spans_reach_an_otlp_http_endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_port}/v1/traces"
        t = Tracing(TracingConfig(otlp_endpoint=endpoint, service_name="loraplex-test"))
        assert t.enabled
        request(t)
        t.shutdown()  # flushes the batch
    finally:
        server.shutdown()
    names, services = [], set()
    for path, body in _Collector.bodies:
        assert path == "/v1/traces"
        msg = ExportTraceServiceRequest.FromString(body)
        for rs in msg.resource_spans:
            services |= {a.value.string_value for a in rs.resource.attributes if a.key == "service.name"}
            names += [s.name for ss in rs.scope_spans for s in ss.spans]
    assert sorted(names) == sorted(["request", "admission", "queue", "prefill", "decode", "metering"])
    assert services == {"loraplex-test"}


def test_a_bad_sample_ratio_is_refused():
    with pytest.raises(ValueError):
        TracingConfig(sample_ratio=1.5)


def test_off_imports_no_opentelemetry_at_all_and_sends_no_trace_header():
    code = ("import asyncio, sys\n"
            "from loraplex.platform.observability.tracing import Tracing, TracingConfig, inject_trace_context\n"
            "t = Tracing(TracingConfig())\nwith t.request_span(), t.span('admission'):\n    pass\n"
            "async def call():\n    headers = {}\n    inject_trace_context(headers)\n    return headers\n"
            "print(asyncio.run(t.start_request().carried(call())))\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["{}", "[]"]


def test_a_request_trace_needs_no_current_span_and_survives_other_tasks():
    import asyncio

    exporter = InMemorySpanExporter()
    t = Tracing(TracingConfig(), exporter=exporter)

    async def main():
        with bind_request_id("req-9"):
            trace = t.start_request(lane="batch")

        async def admission():
            with trace.span("admission"):
                await asyncio.sleep(0)

        await asyncio.create_task(admission())  # another task, another context
        now = time.monotonic()
        trace.record_phases(now - 1.0, now - 0.5, now - 0.2, now)
        trace.end(finish_reason="stop")

    asyncio.run(main())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"request", "admission", "queue", "prefill", "decode"}
    root = spans.pop("request")
    assert root.attributes["loraplex.finish_reason"] == "stop" and root.attributes["loraplex.request_id"] == "req-9"
    assert all(s.parent.span_id == root.context.span_id for s in spans.values())
    off = Tracing(TracingConfig()).start_request()
    with off.span("admission") as span:
        assert span is None
    off.record_phases(0.0, 1.0, 2.0, 3.0)
    off.end()


def test_calls_made_while_a_request_is_awaited_carry_its_span_as_traceparent():
    import asyncio

    exporter = InMemorySpanExporter()
    t = Tracing(TracingConfig(), exporter=exporter)
    trace = t.start_request()

    async def call() -> dict[str, str]:  # what the remote engine client does before it sends
        headers = {"content-type": "application/json"}
        inject_trace_context(headers)
        return headers

    carried, bare = asyncio.run(trace.carried(call())), asyncio.run(call())
    trace.end()
    (root,) = exporter.get_finished_spans()
    version, trace_id, span_id, flags = carried["traceparent"].split("-")
    assert (version, trace_id, span_id) == ("00", f"{root.context.trace_id:032x}", f"{root.context.span_id:016x}")
    assert int(flags, 16) & 1  # sampled: the worker records its spans too
    assert "traceparent" not in bare  # outside `carried`, nothing is sent


def test_a_callers_traceparent_parents_the_request_span_and_a_malformed_one_is_ignored():
    import asyncio

    exporter = InMemorySpanExporter()
    t = Tracing(TracingConfig(), exporter=exporter)

    async def app(scope, receive, send) -> None:  # a handler starting its request's root span
        t.start_request().end()

    middleware = TraceContextMiddleware(app)
    for value in (f"00-{TRACE}-{SPAN}-01", "00-not-a-trace-context"):
        asyncio.run(middleware({"type": "http", "headers": [(b"traceparent", value.encode())]}, None, None))
    continued, fresh = exporter.get_finished_spans()
    assert (f"{continued.context.trace_id:032x}", f"{continued.parent.span_id:016x}") == (TRACE, SPAN)
    assert continued.parent.is_remote
    assert fresh.parent is None and f"{fresh.context.trace_id:032x}" != TRACE
