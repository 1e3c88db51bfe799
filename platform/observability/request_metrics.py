"""Per-lane and per-adapter request metrics, with vLLM's names where vLLM has one.

Labels: model_name, lane and adapter, never tenant or key (tenant usage is metering's).
The adapter label set is bounded: the first `max_adapter_labels` adapters seen keep
their name, later ones share `_other`; base-model requests are `_base`.

Four of these series (SUPERSEDES) have the names of the unlabelled ones the gateway's
metrics had before, so scrapers and dashboards keep them, now with lane and adapter.
"""
from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram

BASE_ADAPTER = "_base"
OTHER_ADAPTER = "_other"
# vLLM's buckets, so dashboards built for vLLM read these unchanged; TTFT has 2.0 added,
# the default SLO, so the share of requests within it is exact (le="2.0").
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SUPERSEDES = frozenset({"vllm:prompt_tokens", "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
                        "vllm:e2e_request_latency_seconds"})


class AdapterLabels:
    """Maps adapter names to a bounded label set (first come keeps its name)."""

    def __init__(self, max_labels: int = 50, preset: Iterable[str] = ()) -> None:
        if max_labels < 0:
            raise ValueError("max_labels must be >= 0")
        self.max_labels = max_labels
        self._named: set[str] = set()
        for name in preset:
            self(name)

    def __call__(self, adapter: str | None) -> str:
        if adapter is None:
            return BASE_ADAPTER
        if adapter in self._named:
            return adapter
        if len(self._named) < self.max_labels:
            self._named.add(adapter)
            return adapter
        return OTHER_ADAPTER

    @property
    def named(self) -> frozenset[str]:
        return frozenset(self._named)


class RequestMetrics:
    """Histograms and counters observed as requests run; `lane` is the lane's lower-case name."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_adapter_labels: int = 50,
                 lanes: Iterable[str] = ("interactive", "standard", "batch")) -> None:
        self.model_name = model_name
        self.adapter_label = AdapterLabels(max_adapter_labels)
        r, la = registry, ["model_name", "lane", "adapter"]

        def hist(name: str, doc: str, buckets: tuple[float, ...], labels: list[str] = la) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self._ttft = hist("vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self._tpot = hist("vllm:time_per_output_token_seconds",
                          "Mean time per output token after the first, per request, in seconds.", TPOT_BUCKETS)
        self._e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                         LATENCY_BUCKETS)
        self._queue = hist("vllm:request_queue_time_seconds", "Time waiting before first scheduled, in seconds.",
                           LATENCY_BUCKETS)
        self._prefill = hist("vllm:request_prefill_time_seconds", "Time from first scheduled to first token.",
                             LATENCY_BUCKETS)
        self._decode = hist("vllm:request_decode_time_seconds", "Time from first token to the last.",
                            LATENCY_BUCKETS)
        self._prompt = Counter("vllm:prompt_tokens", "Prefill tokens processed.", la, registry=r)
        self._gen = Counter("vllm:generation_tokens", "Generation tokens processed.", la, registry=r)
        m = ["model_name", "adapter"]
        self._loads = Counter("loraplex:adapter_loads", "Adapter loads into a device slot.", m, registry=r)
        self._evictions = Counter("loraplex:adapter_evictions", "Adapters evicted from a device slot.", m,
                                  registry=r)
        self._load_time = hist("loraplex:adapter_load_seconds", "Adapter load latency in seconds.", LOAD_BUCKETS,
                               ["model_name"])
        self._preempt = Counter("loraplex:lane_preemptions", "Requests preempted, by the lane they ran in.",
                                ["model_name", "lane"], registry=r)
        # Base-model series of every lane exist (at 0) from the start, so a scraper sees
        # every name before the first request.
        for lane in lanes:
            for metric in (self._ttft, self._tpot, self._e2e, self._queue, self._prefill, self._decode,
                           self._prompt, self._gen):
                metric.labels(model_name, lane, BASE_ADAPTER)
            self._preempt.labels(model_name, lane)
        self._load_time.labels(model_name)

    def _labels(self, lane: str, adapter: str | None) -> tuple[str, str, str]:
        return self.model_name, lane, self.adapter_label(adapter)

    def first_token(self, lane: str, adapter: str | None, *, queue_s: float | None, prefill_s: float | None,
                    prompt_tokens: int, ttft_s: float | None = None) -> None:
        """At a request's first token: queue and prefill time (each None when unknown);
        TTFT is `ttft_s` when given (as the client saw it), else their sum."""
        labels = self._labels(lane, adapter)
        if queue_s is not None:
            self._queue.labels(*labels).observe(queue_s)
        if prefill_s is not None:
            self._prefill.labels(*labels).observe(prefill_s)
        if ttft_s is None:
            ttft_s = (queue_s or 0.0) + (prefill_s or 0.0)
        self._ttft.labels(*labels).observe(ttft_s)
        self._prompt.labels(*labels).inc(prompt_tokens)

    def generated(self, lane: str, adapter: str | None, n: int) -> None:
        self._gen.labels(*self._labels(lane, adapter)).inc(n)

    def finished(self, lane: str, adapter: str | None, *, e2e_s: float, decode_s: float | None,
                 output_tokens: int) -> None:
        """At a request's end; decode_s is None when no token was sampled."""
        labels = self._labels(lane, adapter)
        self._e2e.labels(*labels).observe(e2e_s)
        if decode_s is not None:
            self._decode.labels(*labels).observe(decode_s)
            if output_tokens > 1:
                self._tpot.labels(*labels).observe(decode_s / (output_tokens - 1))

    def adapter_loaded(self, adapter: str, seconds: float | None, n: int = 1) -> None:
        """`n` loads of `adapter` into a device slot, each taking `seconds` (None: untimed)."""
        self._loads.labels(self.model_name, self.adapter_label(adapter)).inc(n)
        if seconds is not None:
            for _ in range(n):
                self._load_time.labels(self.model_name).observe(seconds)

    def adapter_evicted(self, adapter: str, n: int = 1) -> None:
        self._evictions.labels(self.model_name, self.adapter_label(adapter)).inc(n)

    def preempted(self, lane: str, n: int = 1) -> None:
        self._preempt.labels(self.model_name, lane).inc(n)
