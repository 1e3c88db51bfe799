"""Prometheus metrics with vLLM's names, one registry per app (a gateway's or a worker's).

Engine-state series (running/waiting, KV usage, preemptions, prefix cache, lanes) are
read from the engine's stats snapshot at scrape time; per-request series (tokens,
latencies by lane and adapter: `observability.request_metrics.RequestMetrics`) are
observed as requests run (`request_observer.RequestObserver`), and engine events (preemptions by lane,
adapter loads, evictions and load latency) are carried over from the snapshot at each
scrape. Label sets stay bounded: model_name, lane, adapter (a bounded set), finish
reason, endpoint and status code; never tenant or key ids.

The series an endpoint picker (Gateway API Inference Extension, llm-d) scores on:
queue and running depth, KV usage, `vllm:cache_config_info` (block size and count),
`vllm:lora_requests_info` (adapters with requests running or waiting, as vLLM reports
them and today's pickers read them) and `vllm:lora_adapter_loaded` (which adapters sit
in the device tier, `level="gpu"`, or the CPU tier, before any traffic for them), so a
picker can send a request where its adapter already lives.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loraplex.engine.client import AdapterResidency, EngineStats, SpecDecodeStats
from loraplex.platform.lanes import Lane, lane_name
from loraplex.platform.observability.request_metrics import BASE_ADAPTER, RequestMetrics

BASE_ADAPTER_LABEL = BASE_ADAPTER  # adapter label of base-model requests (adapter names cannot start with _)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Finish reasons whose end-to-end latency is a served request's (aborted and failed
# ones would skew the histogram toward the client's patience).
_SERVED = ("stop", "length", "timeout")
# Adapter names remembered with the version they last ran (for the residency series);
# only those resident or in use are kept past a scrape, and never more than this.
MAX_ADAPTER_NAMES = 4096
# vLLM's residency levels: "gpu" is the engine's device tier (the CPU itself on a CPU engine).
_LEVELS = {"device": "gpu", "cpu": "cpu"}


class Metrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats], max_lora: int | None,
                 max_adapter_labels: int = 50, residency: Callable[[], AdapterResidency] | None = None) -> None:
        """`residency`: where adapter versions sit now (the engine client's `adapter_residency`;
        default: the stats snapshot's view)."""
        disable_created_metrics()  # no *_created series (process-wide; vLLM does the same)
        self.model_name = model_name
        self.max_lora = max_lora
        self.stats = stats
        self.residency = residency or (lambda: stats().adapters)
        # adapter name -> the version (digest) it last ran, most recent last.
        self.versions: OrderedDict[str, str] = OrderedDict()
        self.registry = r = CollectorRegistry()
        self.requests = RequestMetrics(r, model_name, max_adapter_labels)
        m = ["model_name"]
        self._itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", m,
                              buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._adapter_requests = Counter("loraplex:adapter_requests", "Requests by adapter (_base: none).",
                                         ["adapter"], registry=r)
        self._api = Counter("loraplex:api_requests", "API requests by endpoint and HTTP status.",
                            ["endpoint", "status"], registry=r)
        self.refusals_held = Gauge("loraplex:refusals_held", "429 answers being held before they are sent.",
                                   registry=r)
        # adapter -> [waiting, running] as the gateway sees them (waiting until first token).
        self.lora_state: dict[str, list[int]] = {}
        self._events = _EngineEvents(self.requests)
        r.register(_EngineCollector(self, stats))

    # -- per request (hot path: a few counter/histogram updates) ----------------------
    def request_started(self, adapter: str | None, lane: Lane, digest: str | None = None) -> None:
        """`digest`: the version the adapter name resolved to (names the residency series)."""
        self._adapter_requests.labels(adapter or BASE_ADAPTER_LABEL).inc()
        if adapter is not None:
            self.lora_state.setdefault(adapter, [0, 0])[0] += 1
            if digest is not None:
                self.adapter_named(adapter, digest)

    def adapter_named(self, name: str, digest: str) -> None:
        """`name` means version `digest` now (a request ran it, or it was loaded by name)."""
        self.versions[name] = digest
        self.versions.move_to_end(name)
        if len(self.versions) > MAX_ADAPTER_NAMES:
            self.versions.popitem(last=False)

    def first_token(self, adapter: str | None, lane: Lane, ttft: float, prompt_tokens: int,
                    queue_s: float | None = None, prefill_s: float | None = None) -> None:
        """`ttft` as the gateway saw it; queue and prefill time as the engine measured them
        (None from an engine that does not say)."""
        self.requests.first_token(lane_name(lane), adapter, queue_s=queue_s, prefill_s=prefill_s,
                                  prompt_tokens=prompt_tokens, ttft_s=ttft)
        if adapter is not None:
            s = self.lora_state[adapter]
            s[0] -= 1
            s[1] += 1

    def inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def generated(self, adapter: str | None, lane: Lane, n: int) -> None:
        self.requests.generated(lane_name(lane), adapter, n)

    def request_finished(self, adapter: str | None, lane: Lane, never_started: bool, e2e: float,
                         reason: str, decode_s: float | None = None, output_tokens: int = 0) -> None:
        if reason in _SERVED:
            self.requests.finished(lane_name(lane), adapter, e2e_s=e2e, decode_s=decode_s,
                                   output_tokens=output_tokens)
        self._success.labels(self.model_name, reason).inc()
        if adapter is not None:
            s = self.lora_state[adapter]
            s[0 if never_started else 1] -= 1
            if s == [0, 0]:
                del self.lora_state[adapter]

    def api_request(self, endpoint: str, status: int) -> None:
        self._api.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        self._events.sync(self.stats())
        return generate_latest(self.registry)


class _EngineEvents:
    """Carries the engine's cumulative event counts over into the request metrics: what
    happened since the last scrape (an engine whose counts went back restarted)."""

    def __init__(self, requests: RequestMetrics) -> None:
        self.requests = requests
        self._preemptions: dict[Lane, int] = {}
        self._loads: dict[str, int] = {}
        self._evictions: dict[str, int] = {}
        self._last_load = 0

    def sync(self, s: EngineStats) -> None:
        for lane, n in s.preemptions_by_lane.items():
            if d := _delta(self._preemptions, lane, n):
                self.requests.preempted(lane_name(lane), d)
        timed: dict[str, int] = {}
        loads = s.recent_adapter_loads
        if loads and loads[-1].seq < self._last_load:
            self._last_load = 0
        for load in loads:
            if load.seq > self._last_load:
                self.requests.adapter_loaded(load.adapter, load.seconds)
                timed[load.adapter] = timed.get(load.adapter, 0) + 1
        self._last_load = loads[-1].seq if loads else self._last_load
        for adapter, n in s.adapter_loads.items():
            # Loads that fell out of the recent window between scrapes are counted untimed.
            if (d := _delta(self._loads, adapter, n) - timed.get(adapter, 0)) > 0:
                self.requests.adapter_loaded(adapter, None, d)
        for adapter, n in s.adapter_evictions.items():
            if d := _delta(self._evictions, adapter, n):
                self.requests.adapter_evicted(adapter, d)


def _delta(seen: dict, key, now: int) -> int:
    before = seen.get(key, 0)
    seen[key] = now
    return now - before if now >= before else now


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
        yield gauge("loraplex:num_requests_paused", "Running requests paused for a streaming client that "
                    "stopped reading or fell behind (holding KV blocks and seats, taking no steps).", s.paused)
        # The one KV pool, on the GPU or the CPU alike; vLLM's older name too.
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", s.kv_cache_usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (1 = full); vLLM's older name.", s.kv_cache_usage)
        yield counter("vllm:num_preemptions", "Preemptions.", s.num_preemptions)
        yield counter("vllm:prefix_cache_queries", "Prefix-cache queried tokens.", s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix-cache hit tokens.", s.prefix_cache_hits)
        for kind in ("running", "waiting"):
            g = GaugeMetricFamily(f"loraplex:lane_requests_{kind}", f"Requests {kind} by lane.", labels=["lane"])
            for lane in Lane:
                g.add_metric([lane_name(lane)], getattr(s.lanes[lane], kind))
            yield g
        fg = GaugeMetricFamily("loraplex:lane_foreground", "1 for the lane whose arrivals the lanes below "
                               "make room for (none while one lane has all the work).", labels=["lane"])
        for lane in Lane:
            fg.add_metric([lane_name(lane)], 1.0 if s.foreground_lane is lane else 0.0)
        yield fg
        yield gauge("loraplex:lane_background_step_tokens", "Tokens of each step the lanes below the "
                    "foreground get now (sized from measured step times).", s.background_step_tokens)
        state = self.m.lora_state
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters.",
                                 labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([",".join(sorted(a for a, v in state.items() if v[1] > 0)),
                         ",".join(sorted(a for a, v in state.items() if v[0] > 0)), str(self.m.max_lora or s.max_loras)],
                        time.time())
        yield info
        yield from _residency_families(self.m)
        if s.spec_decode is not None:
            yield from _spec_decode_families(s.spec_decode, name)
        # The one KV pool, on the GPU or the CPU alike (vLLM's label names).
        cache = GaugeMetricFamily("vllm:cache_config_info", "KV-cache configuration (value 1).",
                                  labels=["block_size", "num_gpu_blocks"])
        cache.add_metric([str(s.block_size), str(s.num_blocks)], 1.0)
        yield cache


def _spec_decode_families(spec: SpecDecodeStats, name: list[str]):
    """vLLM's speculative-decoding counters, and the acceptance of each adapter's drafts."""
    for metric, doc, value in (
            ("vllm:spec_decode_num_drafts", "Draft runs verified.", spec.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens)):
        c = CounterMetricFamily(metric, doc, labels=["model_name"])
        c.add_metric(name, value)
        yield c
    pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by "
                              "position in the draft.", labels=["model_name", "position"])
    for i, n in enumerate(spec.accepted_per_position):
        pos.add_metric(name + [str(i)], n)
    yield pos
    drafted = CounterMetricFamily("loraplex:spec_decode_adapter_draft_tokens", "Draft tokens verified, by "
                                  "adapter (_base: none).", labels=["adapter"])
    accepted = CounterMetricFamily("loraplex:spec_decode_adapter_accepted_tokens", "Draft tokens accepted, "
                                   "by adapter (_base: none).", labels=["adapter"])
    for adapter, (d, a) in sorted(spec.by_adapter.items()):
        drafted.add_metric([adapter or "_base"], d)
        accepted.add_metric([adapter or "_base"], a)
    yield drafted
    yield accepted


def _residency_families(m: Metrics):
    """vLLM's adapter residency shape: one series per adapter name and level, and the
    count of versions per level. A name is shown where the version it last ran sits; a
    name whose version left both tiers (and has no request in flight) is forgotten."""
    where = m.residency().where()
    loaded = GaugeMetricFamily("vllm:lora_adapter_loaded", "1 for each adapter resident at a level "
                               "(gpu: the device tier; cpu: the CPU tier).", labels=["adapter_name", "level", "pinned"])
    for name, digest in list(m.versions.items()):
        if (tier := where.get(digest)) is not None:
            # Nothing pins an adapter for good; one in use by a running request is kept
            # only while it runs (lora_requests_info lists those).
            loaded.add_metric([name, _LEVELS[tier], "false"], 1.0)
        elif name not in m.lora_state:
            del m.versions[name]
    yield loaded
    for tier, level in _LEVELS.items():
        g = GaugeMetricFamily(f"vllm:num_{level}_loaded_lora_adapters", f"Adapter versions in the {tier} tier.",
                              labels=["model_name"])
        g.add_metric([m.model_name], sum(1 for t in where.values() if t == tier))
        yield g
