"""/metrics: vLLM's names, parseable, counters that move as requests run."""
from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

REQUIRED = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
    "vllm:num_preemptions_total", "vllm:lora_requests_info", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "loraplex:lane_requests_running", "loraplex:lane_requests_waiting",
    "loraplex:lane_foreground", "loraplex:lane_background_step_tokens", "vllm:cache_config_info",
    "vllm:num_gpu_loaded_lora_adapters", "vllm:num_cpu_loaded_lora_adapters", "loraplex:num_requests_paused",
]


def scrape(live) -> dict[tuple[str, frozenset], float]:
    r = httpx.get(f"{live.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def value(samples, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


def test_metrics_names_and_bounded_labels(live):
    samples = scrape(live)
    names = {n for n, _ in samples}
    assert set(REQUIRED) <= names
    for _, labels in samples:
        assert not {k for k, _ in labels} & {"tenant", "key", "key_id", "api_key", "user"}
    model = {("model_name", live.model)}
    assert any(n == "vllm:num_requests_running" and ls == model for n, ls in samples)
    info = [ls for n, ls in samples if n == "vllm:lora_requests_info"]
    # No --max-loras: as many adapters per step as sequences (max_num_seqs 128)
    assert len(info) == 1 and ("max_lora", "128") in info[0]


def test_counters_move(live):
    before = scrape(live)
    r = live.client("beta").completions.create(model=live.model, prompt="count these tokens", max_tokens=5,
                                               temperature=0, extra_body={"ignore_eos": True})
    with pytest.raises(openai.NotFoundError):
        live.client("beta").completions.create(model="acme-private", prompt="x", max_tokens=1)
    after = scrape(live)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 4
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("loraplex:adapter_requests_total", adapter="_base") == 1
    assert delta("loraplex:api_requests_total", endpoint="completions", status="200") == 1
    assert delta("loraplex:api_requests_total", endpoint="completions", status="404") == 1
    assert value(after, "vllm:prefix_cache_queries_total") >= value(before, "vllm:prefix_cache_queries_total")


def test_adapter_requests_counted_by_name(live):
    before = scrape(live)
    live.client("gamma").completions.create(model="pub", prompt="x", max_tokens=2)
    after = scrape(live)
    assert value(after, "loraplex:adapter_requests_total", adapter="pub") - \
        value(before, "loraplex:adapter_requests_total", adapter="pub") == 1


def test_endpoint_picker_series(live):
    """What a GAIE / llm-d endpoint picker reads: the KV pool's shape, the adapters with
    requests, and where each adapter sits (vLLM's names and labels)."""
    live.client("gamma").completions.create(model="pub", prompt="where do I live", max_tokens=2)
    r = httpx.get(f"{live.url}/metrics")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    stats = live.engine.stats()
    (cache,) = families["vllm:cache_config_info"].samples
    assert cache.value == 1 and cache.labels == {"block_size": str(stats.block_size),
                                                 "num_gpu_blocks": str(stats.num_blocks)}
    assert stats.block_size == 16 and stats.num_blocks == 128
    (info,) = families["vllm:lora_requests_info"].samples
    assert set(info.labels) == {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}
    loaded = {s.labels["adapter_name"]: s for s in families["vllm:lora_adapter_loaded"].samples}
    assert loaded["pub"].value == 1 and loaded["pub"].labels == {"adapter_name": "pub", "level": "gpu",
                                                                 "pinned": "false"}
    digest = live.gateway.adapter_ref("pub").digest
    assert digest in live.engine.adapter_residency().device
    gpu = families["vllm:num_gpu_loaded_lora_adapters"].samples[0].value
    assert gpu == len(live.engine.adapter_residency().device) >= 1
