"""The one per-request observer the gateway and the worker share: what it feeds the
Prometheus series and the request's trace, with the real Metrics and an in-memory exporter."""
from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.client import EngineStats
from loraplex.engine.output import RequestOutput
from loraplex.platform.lanes import Lane
from loraplex.platform.observability.request_observer import RequestObserver
from loraplex.platform.observability.tracing import Tracing, TracingConfig
from loraplex.platform.metrics import Metrics


def _samples(m: Metrics) -> dict[str, float]:
    """Each `_count`/`_total` sample by name (finish-reason counters as name:reason)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            if s.name.endswith(("_count", "_total")):
                key = f"{s.name}:{s.labels['finished_reason']}" if "finished_reason" in s.labels else s.name
                out[key] = out.get(key, 0) + s.value
    return out


def _out(tokens: list[int], finished: bool = False, queue: float | None = None) -> RequestOutput:
    return RequestOutput("r", tokens, "x" * len(tokens), finished, "stop" if finished else None, 4, 0,
                         queue_time=queue, prefill_time=0.01 if queue is not None else None)


def _observe(m: Metrics, t: Tracing, outs: list[RequestOutput], reason: str, output_tokens: int | None) -> list[bool]:
    obs = RequestObserver(m, t.start_request(lane="standard"), "ad1", Lane.STANDARD)
    firsts = [obs.output(o) for o in outs]
    obs.finish(reason, output_tokens)
    return firsts


def test_first_token_gaps_and_the_end_are_counted_once_each():
    m = Metrics("base", lambda: EngineStats(block_size=16, num_blocks=64), max_lora=2)
    exporter = InMemorySpanExporter()
    t = Tracing(TracingConfig(), exporter=exporter)
    # A prefill-progress output (no token) is not the first token; the next one is.
    firsts = _observe(m, t, [_out([]), _out([5], queue=0.02), _out([6]), _out([7], True)], "stop", 3)
    assert firsts == [False, True, False, False]
    got = _samples(m)
    assert got["vllm:time_to_first_token_seconds_count"] == 1
    assert got["vllm:inter_token_latency_seconds_count"] == 2
    assert got["vllm:request_success_total:stop"] == 1
    assert {s.name for s in exporter.get_finished_spans()} >= {"queue", "prefill", "decode"}


def test_a_request_that_never_produced_a_token_has_no_first_token():
    m = Metrics("base", lambda: EngineStats(block_size=16, num_blocks=64), max_lora=2)
    firsts = _observe(m, Tracing(TracingConfig()), [_out([])], "abort", None)
    assert firsts == [False]
    got = _samples(m)
    assert got.get("vllm:time_to_first_token_seconds_count", 0) == 0
    assert got.get("vllm:inter_token_latency_seconds_count", 0) == 0
