from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.client import AdapterLoad, EngineStats
from loraplex.engine.request import Lane
from loraplex.platform.metrics import Metrics
from loraplex.platform.observability.request_metrics import (
    BASE_ADAPTER, OTHER_ADAPTER, SUPERSEDES, AdapterLabels, RequestMetrics)


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_adapter_labels_are_bounded():
    labels = AdapterLabels(max_labels=2, preset=["sql"])
    assert [labels(a) for a in ["sql", "chat", "poems", None, "chat", "sql"]] == \
        ["sql", "chat", OTHER_ADAPTER, BASE_ADAPTER, "chat", "sql"]
    assert labels.named == {"sql", "chat"}


def test_a_request_is_observed_per_lane_and_adapter():
    reg = CollectorRegistry()
    m = RequestMetrics(reg, "tiny", max_adapter_labels=1)
    m.first_token("interactive", "sql", queue_s=0.25, prefill_s=0.05, prompt_tokens=30)
    m.generated("interactive", "sql", 5)
    m.finished("interactive", "sql", e2e_s=0.7, decode_s=0.4, output_tokens=5)
    m.first_token("batch", "poems", queue_s=3.0, prefill_s=1.0, prompt_tokens=10)  # past the label bound
    m.finished("batch", "poems", e2e_s=4.0, decode_s=None, output_tokens=0)
    m.adapter_loaded("sql", 0.02)
    m.adapter_evicted("poems")
    m.preempted("batch")
    s = samples(reg)
    sql = (("adapter", "sql"), ("lane", "interactive"), ("model_name", "tiny"))
    other = (("adapter", OTHER_ADAPTER), ("lane", "batch"), ("model_name", "tiny"))
    assert s[("vllm:time_to_first_token_seconds_sum", sql)] == 0.3
    assert s[("vllm:request_queue_time_seconds_sum", sql)] == 0.25
    assert s[("vllm:time_per_output_token_seconds_sum", sql)] == 0.1  # 0.4 s over 4 tokens after the first
    assert s[("vllm:time_per_output_token_seconds_count", sql)] == 1
    assert s[("vllm:prompt_tokens_total", sql)] == 30 and s[("vllm:generation_tokens_total", sql)] == 5
    assert s[("vllm:e2e_request_latency_seconds_sum", other)] == 4.0
    assert ("vllm:time_per_output_token_seconds_count", other) not in s  # nothing decoded
    assert s[("loraplex:adapter_loads_total", (("adapter", "sql"), ("model_name", "tiny")))] == 1
    assert s[("loraplex:adapter_evictions_total", (("adapter", OTHER_ADAPTER), ("model_name", "tiny")))] == 1
    assert s[("loraplex:adapter_load_seconds_count", (("model_name", "tiny"),))] == 1
    assert s[("loraplex:lane_preemptions_total", (("lane", "batch"), ("model_name", "tiny")))] == 1
    assert not any(k == "tenant" for _, labels in s for k, _ in labels)


def test_the_gateway_exports_the_superseded_names_once_with_lane_and_adapter():
    gateway = Metrics("tiny", EngineStats, max_lora=2)
    gateway.request_started(None, Lane.BATCH)
    gateway.first_token(None, Lane.BATCH, 0.5, 7, 0.4, 0.1)
    gateway.generated(None, Lane.BATCH, 2)
    gateway.request_finished(None, Lane.BATCH, False, 0.9, "length", 0.4, 2)
    families = [f.name for f in gateway.registry.collect()]
    assert all(families.count(name) == 1 for name in SUPERSEDES)
    s = samples(gateway.registry)
    base = (("adapter", BASE_ADAPTER), ("lane", "batch"), ("model_name", "tiny"))
    assert s[("vllm:time_to_first_token_seconds_sum", base)] == 0.5  # as the gateway saw it
    assert s[("vllm:request_queue_time_seconds_sum", base)] == 0.4
    assert s[("vllm:prompt_tokens_total", base)] == 7 and s[("vllm:generation_tokens_total", base)] == 2
    assert s[("vllm:e2e_request_latency_seconds_count", base)] == 1


def test_engine_events_are_carried_over_once_per_scrape():
    stats = [EngineStats()]
    gateway = Metrics("tiny", lambda: stats[-1], max_lora=2)

    def snapshot(preempted: int, loads: list[tuple[int, str, float]], evictions: dict[str, int]) -> EngineStats:
        counts: dict[str, int] = {}
        for _, name, _ in loads:
            counts[name] = counts.get(name, 0) + 1
        return EngineStats(preemptions_by_lane={Lane.INTERACTIVE: 0, Lane.STANDARD: preempted, Lane.BATCH: 0},
                           adapter_loads=counts, adapter_evictions=evictions,
                           recent_adapter_loads=tuple(AdapterLoad(*x) for x in loads[-2:]))

    stats.append(snapshot(2, [(1, "sql", 0.5), (2, "chat", 0.25)], {}))
    gateway.render()
    # Three more loads, only the last two still in the recent window: one is counted untimed.
    stats.append(snapshot(3, [(1, "sql", 0.5), (2, "chat", 0.25), (3, "sql", 1.0), (4, "sql", 2.0),
                              (5, "chat", 4.0)], {"sql": 1}))
    gateway.render()
    gateway.render()  # nothing new: nothing counted twice
    s = samples(gateway.registry)
    assert s[("loraplex:lane_preemptions_total", (("lane", "standard"), ("model_name", "tiny")))] == 3
    assert s[("loraplex:adapter_loads_total", (("adapter", "sql"), ("model_name", "tiny")))] == 3
    assert s[("loraplex:adapter_loads_total", (("adapter", "chat"), ("model_name", "tiny")))] == 2
    assert s[("loraplex:adapter_evictions_total", (("adapter", "sql"), ("model_name", "tiny")))] == 1
    assert s[("loraplex:adapter_load_seconds_count", (("model_name", "tiny"),))] == 4
    assert s[("loraplex:adapter_load_seconds_sum", (("model_name", "tiny"),))] == 0.5 + 0.25 + 2.0 + 4.0
