"""Prometheus metrics with vLLM's names, one registry per app.

Engine-state series (running/waiting, KV usage, preemptions, prefix cache, lanes) are
read from the engine's stats snapshot at scrape time; per-request series (tokens,
latencies, adapters) are observed by the gateway as requests run. Label sets stay
bounded: model_name, lane, adapter (registered names only), finish reason, endpoint and
status code; never tenant or key ids.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loraplex.engine.client import EngineStats
from loraplex.platform.lanes import Lane, lane_name

BASE_ADAPTER_LABEL = "_base"  # adapter label of base-model requests (adapter names cannot start with _)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self, model_name: str, stats: Callable[[], dict], max_lora: int) -> None:
        disable_created_metrics()  # no *_created series (process-wide; vLLM does the same)
        self.model_name = model_name
        self.max_lora = max_lora
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        self._prompt = Counter("vllm:prompt_tokens", "Prefill tokens processed.", m, registry=r).labels(model_name)
        self._gen = Counter("vllm:generation_tokens", "Generation tokens processed.", m,
                            registry=r).labels(model_name)
        self._ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", m,
                               buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self._itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", m,
                              buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", m,
                              buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._adapter_requests = Counter("loraplex:adapter_requests", "Requests by adapter (_base: none).",
                                         ["adapter"], registry=r)
        self._api = Counter("loraplex:api_requests", "API requests by endpoint and HTTP status.",
                            ["endpoint", "status"], registry=r)
        # adapter -> [waiting, running] as the gateway sees them (waiting until first token).
        self.lora_state: dict[str, list[int]] = {}
        r.register(_EngineCollector(self, stats))

    # -- per request (hot path: a few counter/histogram updates) ----------------------
    def request_started(self, adapter: str | None, lane: Lane) -> None:
        self._adapter_requests.labels(adapter or BASE_ADAPTER_LABEL).inc()
        if adapter is not None:
            self.lora_state.setdefault(adapter, [0, 0])[0] += 1

    def first_token(self, adapter: str | None, ttft: float, prompt_tokens: int) -> None:
        self._ttft.observe(ttft)
        self._prompt.inc(prompt_tokens)
        if adapter is not None:
            s = self.lora_state[adapter]
            s[0] -= 1
            s[1] += 1

    def inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def generated(self, n: int) -> None:
        self._gen.inc(n)

    def request_finished(self, adapter: str | None, lane: Lane, never_started: bool, e2e: float,
                         reason: str) -> None:
        if reason in ("stop", "length"):
            self._e2e.observe(e2e)
        self._success.labels(self.model_name, reason).inc()
        if adapter is not None:
            s = self.lora_state[adapter]
            s[0 if never_started else 1] -= 1
            if s == [0, 0]:
                del self.lora_state[adapter]

    def api_request(self, endpoint: str, status: int) -> None:
        self._api.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Engine-state series, read from the engine's stats snapshot at scrape time."""

    def __init__(self, metrics: Metrics, stats: Callable[[], EngineStats]) -> None:
        self.m = metrics
        self.stats = stats

    def collect(self):
        s, name = self.stats(), [self.m.model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric(name, value)
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric(name, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", s.kv_cache_usage)
        yield counter("vllm:num_preemptions", "Preemptions.", s.num_preemptions)
        yield counter("vllm:prefix_cache_queries", "Prefix-cache queried tokens.", s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix-cache hit tokens.", s.prefix_cache_hits)
        for kind in ("running", "waiting"):
            g = GaugeMetricFamily(f"loraplex:lane_requests_{kind}", f"Requests {kind} by lane.", labels=["lane"])
            for lane in Lane:
                g.add_metric([lane_name(lane)], getattr(s.lanes[lane], kind))
            yield g
        state = self.m.lora_state
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters.",
                                 labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([",".join(sorted(a for a, v in state.items() if v[1] > 0)),
                         ",".join(sorted(a for a, v in state.items() if v[0] > 0)), str(self.m.max_lora)],
                        time.time())
        yield info
