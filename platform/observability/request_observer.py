"""One request's metrics and engine-phase spans as its outputs go by: the loop the gateway
(`serving/gateway.py`) and the worker (`worker/stream.py`) both run over an engine stream.

The observer times from its creation: time to first token, inter-token gaps, tokens
generated, and at the end the request's latency and the engine's queue / prefill / decode
phases on its trace. What the request means for billing stays with the caller.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from loraplex.engine.output import RequestOutput
    from loraplex.engine.request import Lane
    from loraplex.platform.observability.tracing import RequestTrace


class RequestMetrics(Protocol):
    """The per-request series an observer feeds (platform/metrics.py's `Metrics`)."""

    def request_started(self, adapter: str | None, lane: Lane, digest: str | None = None) -> None: ...

    def first_token(self, adapter: str | None, lane: Lane, ttft: float, prompt_tokens: int,
                    queue_s: float | None = None, prefill_s: float | None = None) -> None: ...

    def inter_token(self, seconds: float) -> None: ...

    def generated(self, adapter: str | None, lane: Lane, n: int) -> None: ...

    def request_finished(self, adapter: str | None, lane: Lane, never_started: bool, e2e: float,
                         reason: str, decode_s: float | None = None, output_tokens: int = 0) -> None: ...


class RequestObserver:
    """Feeds `metrics` and `trace` for one request; `output` per engine output, `finish` once."""

    def __init__(self, metrics: RequestMetrics, trace: RequestTrace, adapter: str | None, lane: Lane,
                 digest: str | None = None) -> None:
        self.metrics, self.trace, self.adapter, self.lane = metrics, trace, adapter, lane
        self.first = True  # no token yet
        self.times: tuple[float | None, float | None] | None = None  # the engine's (queue, prefill) seconds
        self.t0 = self._last = self._t_first = time.perf_counter()
        metrics.request_started(adapter, lane, digest)

    def output(self, out: RequestOutput) -> bool:
        """Count `out`; True when it carries the request's first token."""
        now = time.perf_counter()
        first = self.first and bool(out.new_token_ids)
        if first:
            self.first, self.times, self._t_first = False, (out.queue_time, out.prefill_time), now
            self.metrics.first_token(self.adapter, self.lane, now - self.t0, out.num_prompt_tokens, *self.times)
        elif out.new_token_ids:
            self.metrics.inter_token(now - self._last)
        self._last = now
        self.metrics.generated(self.adapter, self.lane, len(out.new_token_ids))
        return first

    def finish(self, reason: str, output_tokens: int | None = None) -> None:
        """The request ended (`reason`: its finish reason, "abort" or "error"). With
        `output_tokens` the decode phase is recorded too (the side that bills the request
        does: the gateway); without, only the latency."""
        end = time.perf_counter()
        if output_tokens is None:
            self.metrics.request_finished(self.adapter, self.lane, self.first, end - self.t0, reason)
        else:
            self.metrics.request_finished(self.adapter, self.lane, self.first, end - self.t0, reason,
                                          None if self.first else end - self._t_first, output_tokens)
        self.trace.record_engine_phases(self.t0, *(self.times or (None, None)), end)


__all__ = ["RequestMetrics", "RequestObserver"]
