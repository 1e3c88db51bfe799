"""A loopback OTLP/HTTP traces collector: real exporters (processes started with
`--otlp-endpoint`) post to it, and tests read back the spans they sent."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Span:
    service: str  # the exporting process's service.name
    name: str
    trace_id: str  # hex, as in a traceparent header
    span_id: str
    parent_span_id: str  # "" for a root span
    attributes: dict[str, str]  # the string-valued ones


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.server.bodies.append(self.rfile.read(int(self.headers["content-length"])))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


class OtlpCollector:
    """Keeps every export request it is sent; `endpoint` is the URL to export to."""

    def __init__(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.bodies = []
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}/v1/traces"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def spans(self) -> list[Span]:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        out = []
        for body in list(self._server.bodies):
            for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for s in (s for ss in rs.scope_spans for s in ss.spans):
                    out.append(Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                    {a.key: a.value.string_value for a in s.attributes}))
        return out
