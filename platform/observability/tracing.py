"""OpenTelemetry tracing, off unless an OTLP endpoint is configured.

Off, every span helper returns one shared null context: no SDK import, no allocation.
On, spans go through a batch processor to an OTLP/HTTP exporter. A request gets one
root span (`request`) with children for the phases the gateway and engine see:
admission and metering as they run (`span()`), queue, prefill and decode recorded
afterwards from the engine's timestamps (`record_phases()`).

W3C trace context crosses process boundaries both ways: `TraceContextMiddleware` takes a
caller's `traceparent` (a client's at the gateway, the gateway's at a worker) as the
parent of the requests' root spans, and `inject_trace_context` writes the root span of
the request being awaited (`RequestTrace.carried`) into an outgoing call's headers.
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, MutableMapping
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from .request_id import current_request_id

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

PHASES = ("admission", "queue", "prefill", "decode", "metering")
TRACE_HEADERS = ("traceparent", "tracestate")
_NULL = nullcontext()
T = TypeVar("T")

# The caller's trace context (an OpenTelemetry Context) while its HTTP request is handled;
# set only by TraceContextMiddleware, so never with tracing off.
_incoming: ContextVar[Any] = ContextVar("loraplex_incoming_trace", default=None)
# The context of the request span being awaited (RequestTrace.carried): what a call to
# another process made meanwhile carries.
_outgoing: ContextVar[Any] = ContextVar("loraplex_outgoing_trace", default=None)


@dataclass(frozen=True)
class TracingConfig:
    # OTLP/HTTP traces endpoint, e.g. http://collector:4318/v1/traces; None: tracing off.
    otlp_endpoint: str | None = None
    service_name: str = "loraplex"
    sample_ratio: float = 1.0
    export_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError("sample_ratio must be in [0, 1]")

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_endpoint)


def monotonic_offset_ns() -> int:
    """Add to time.monotonic() nanoseconds to get the wall-clock ones OpenTelemetry records."""
    return time.time_ns() - time.monotonic_ns()


class Tracing:
    """The process's tracer; `Tracing(TracingConfig())` is the no-op one."""

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        self.config = config
        self.enabled = config.enabled or exporter is not None
        self._provider = self._tracer = None
        if self.enabled:
            self._start(exporter)

    def _start(self, exporter: SpanExporter | None) -> None:
        # The SDK is imported only when tracing is on.
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        c = self.config
        provider = TracerProvider(resource=Resource.create({"service.name": c.service_name}),
                                  sampler=ParentBased(TraceIdRatioBased(c.sample_ratio)))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=c.otlp_endpoint, timeout=c.export_timeout_s)
            provider.add_span_processor(BatchSpanProcessor(exporter))
        else:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        self._provider = provider
        self._tracer = provider.get_tracer("loraplex")

    def start_request(self, name: str = "request", **attributes: Any) -> RequestTrace:
        """A request's root span that is never made current: a streamed request's code is
        resumed in other tasks (contexts), so it names its parent explicitly instead.
        Its phases go under it with `span()` and `record_phases()`; `end()` closes it."""
        if not self.enabled:
            return _NULL_TRACE
        from opentelemetry import trace

        root = self._tracer.start_span(name, context=_incoming.get(), attributes=self._attrs(attributes))
        return RequestTrace(self, root, trace.set_span_in_context(root))

    def request_span(self, name: str = "request", **attributes: Any) -> AbstractContextManager[Span | None]:
        """The root span of one request, current until the block ends."""
        if not self.enabled:
            return _NULL
        return self._tracer.start_as_current_span(name, context=_incoming.get(), attributes=self._attrs(attributes))

    def span(self, phase: str, *, parent: Any = None, **attributes: Any) -> AbstractContextManager[Span | None]:
        """A child span of the current one (or of `parent`, an OpenTelemetry context) for a
        phase run inline (admission, metering)."""
        if not self.enabled:
            return _NULL
        assert phase in PHASES, phase
        return self._tracer.start_as_current_span(phase, context=parent, attributes=self._attrs(attributes))

    def record_phases(self, arrival: float, scheduled: float | None, first_token: float | None,
                      finished: float, *, parent: Any = None, **attributes: Any) -> None:
        """Queue, prefill and decode spans under the current span, from monotonic times.

        A phase that never began (aborted while waiting, no token sampled) is left out.
        """
        if not self.enabled:
            return
        attrs, offset = self._attrs(attributes), monotonic_offset_ns()
        bounds = [("queue", arrival, scheduled if scheduled is not None else finished)]
        if scheduled is not None:
            bounds.append(("prefill", scheduled, first_token if first_token is not None else finished))
        if first_token is not None:
            bounds.append(("decode", first_token, finished))
        for phase, start, end in bounds:
            span = self._tracer.start_span(phase, context=parent, attributes=attrs,
                                           start_time=offset + int(start * 1e9))
            span.end(end_time=offset + int(max(start, end) * 1e9))

    @staticmethod
    def _attrs(attributes: dict[str, Any]) -> dict[str, Any]:
        rid = current_request_id()
        attrs = {f"loraplex.{k}": v for k, v in attributes.items() if v is not None}
        if rid is not None:
            attrs["loraplex.request_id"] = rid
        return attrs

    def shutdown(self) -> None:
        """Export what is buffered and stop (at server shutdown)."""
        if self._provider is not None:
            self._provider.shutdown()


class RequestTrace:
    """One request's spans under a root that is not the current span (see `start_request`)."""

    def __init__(self, tracing: Tracing | None, root: Span | None, context: Any) -> None:
        self._tracing, self._root, self._context = tracing, root, context

    def span(self, phase: str, **attributes: Any) -> AbstractContextManager[Span | None]:
        if self._tracing is None:
            return _NULL
        return self._tracing.span(phase, parent=self._context, **attributes)

    def record_phases(self, arrival: float, scheduled: float | None, first_token: float | None,
                      finished: float, **attributes: Any) -> None:
        if self._tracing is not None:
            self._tracing.record_phases(arrival, scheduled, first_token, finished, parent=self._context,
                                        **attributes)

    def record_engine_phases(self, start: float, queue_time: float | None, prefill_time: float | None,
                             end: float, **attributes: Any) -> None:
        """Queue, prefill and decode from the engine's queue and prefill times (as a first
        token's RequestOutput carries them), placed on the caller's monotonic clock from
        when it handed the request over (`start`). No queue time (no token came out):
        all of it counts as queue."""
        if self._tracing is None:
            return
        if queue_time is None:
            self.record_phases(start, None, None, end, **attributes)
            return
        scheduled = start + queue_time
        self.record_phases(start, scheduled, scheduled + (prefill_time or 0.0), end, **attributes)

    def carried(self, step: Awaitable[T]) -> Awaitable[T]:
        """`step` (one await of the engine's stream) with this request's root span as what
        calls to other processes made meanwhile carry (`inject_trace_context`): a remote
        engine's worker continues the trace. Never across a yield, so the context cannot
        leak into the consumer's code. Off: `step` itself."""
        if self._tracing is None:
            return step
        return self._carry(step)

    async def _carry(self, step: Awaitable[T]) -> T:
        token = _outgoing.set(self._context)
        try:
            return await step
        finally:
            _outgoing.reset(token)

    def end(self, **attributes: Any) -> None:
        if self._root is not None:
            self._root.set_attributes({f"loraplex.{k}": v for k, v in attributes.items() if v is not None})
            self._root.end()


_NULL_TRACE = RequestTrace(None, None, None)


def inject_trace_context(headers: MutableMapping[str, str]) -> None:
    """Add W3C `traceparent` (and `tracestate`) for the request span being awaited (see
    `RequestTrace.carried`) to an outgoing call's headers; nothing when there is none,
    which is always the case with tracing off (and then nothing is imported)."""
    ctx = _outgoing.get()
    if ctx is not None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        TraceContextTextMapPropagator().inject(headers, context=ctx)


class TraceContextMiddleware:
    """ASGI middleware, installed only with tracing on: a request's W3C trace context
    (`traceparent`, `tracestate`) becomes the parent of the root spans started while it is
    handled, so a client's trace continues at the gateway, and the gateway's at a worker.
    A malformed header is ignored (the request starts a trace of its own)."""

    def __init__(self, app) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.app = app
        self._propagator = TraceContextTextMapPropagator()
        self._names = frozenset(h.encode() for h in TRACE_HEADERS)

    async def __call__(self, scope, receive, send) -> None:
        carrier = {}
        if scope["type"] == "http":
            carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in self._names}
        if not carrier:
            await self.app(scope, receive, send)
            return
        token = _incoming.set(self._propagator.extract(carrier))
        try:
            await self.app(scope, receive, send)
        finally:
            _incoming.reset(token)
