"""The residency series an endpoint picker scores on, as Metrics renders them from an
engine's residency view: names follow the version they last ran, leave when it leaves
both tiers, and stay bounded."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.client import AdapterResidency, EngineStats
from loraplex.platform.lanes import Lane
from loraplex.platform import metrics as metrics_module
from loraplex.platform.metrics import Metrics


class Tiers:
    """An engine's residency as the test sets it (digests per tier)."""

    def __init__(self) -> None:
        self.now = AdapterResidency()

    def __call__(self) -> AdapterResidency:
        return self.now


def _loaded(m: Metrics) -> dict[str, str]:
    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    out = {s.labels["adapter_name"]: s.labels["level"] for s in families["vllm:lora_adapter_loaded"].samples}
    counts = {lvl: families[f"vllm:num_{lvl}_loaded_lora_adapters"].samples[0].value for lvl in ("gpu", "cpu")}
    (cache,) = families["vllm:cache_config_info"].samples
    assert cache.labels == {"block_size": "16", "num_gpu_blocks": "512"} and cache.value == 1
    return {**out, "_counts": counts}


def test_names_follow_their_version_and_leave_with_it():
    tiers = Tiers()
    m = Metrics("base", lambda: EngineStats(block_size=16, num_blocks=512), max_lora=4, residency=tiers)
    m.request_started("sql", Lane.STANDARD, "sha256:v1")
    assert _loaded(m) == {"_counts": {"gpu": 0, "cpu": 0}}  # in flight, not resident yet: kept, not shown
    assert "sql" in m.versions
    tiers.now = AdapterResidency(device=("sha256:v1",), cpu=("sha256:other",))
    assert _loaded(m) == {"sql": "gpu", "_counts": {"gpu": 1, "cpu": 1}}
    m.request_finished("sql", Lane.STANDARD, True, 0.1, "stop")
    m.adapter_named("sql", "sha256:v2")  # replaced: v1 still sits on the device, but "sql" means v2 now
    assert _loaded(m) == {"_counts": {"gpu": 1, "cpu": 1}} and "sql" not in m.versions
    m.adapter_named("sql", "sha256:v2")
    m.adapter_named("chat", "sha256:v1")  # two names, one content: each name is a series
    tiers.now = AdapterResidency(device=("sha256:v1",), cpu=("sha256:v2",))
    assert _loaded(m) == {"sql": "cpu", "chat": "gpu", "_counts": {"gpu": 1, "cpu": 1}}


def test_remembered_names_are_bounded(monkeypatch):
    monkeypatch.setattr(metrics_module, "MAX_ADAPTER_NAMES", 3)
    m = Metrics("base", lambda: EngineStats(block_size=16, num_blocks=512), max_lora=4, residency=Tiers())
    for i in range(10):
        m.adapter_named(f"a{i}", f"sha256:{i}")
    assert list(m.versions) == ["a7", "a8", "a9"]


def test_speculative_decoding_is_counted_as_vllm_names_it(tiny_llama_dir):
    from loraplex.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
    from loraplex.engine.engine import LLMEngine
    from loraplex.engine.request import SamplingParams
    from tests.engine.oracle import OracleDrafts, draft_whatever_the_timing, hf_greedy

    prompts = [[100 + 37 * i for i in range(20)], [5000 + 11 * i for i in range(9)]]
    ref = hf_greedy(tiny_llama_dir, prompts, [12, 12])
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
                                    speculative=SpeculativeConfig("ngram", 4)), proposer=OracleDrafts(prompts, ref))
    draft_whatever_the_timing(engine)
    engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    text = Metrics("base", engine.stats, max_lora=None).render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(name: str) -> float:
        (sample,) = families[name].samples
        return sample.value

    spec = engine.scheduler.speculation
    assert value("vllm:spec_decode_num_drafts") == spec.num_drafts > 0
    assert value("vllm:spec_decode_num_draft_tokens") == spec.num_draft_tokens
    accepted = value("vllm:spec_decode_num_accepted_tokens")
    assert 0 < accepted < spec.num_draft_tokens
    per_pos = {s.labels["position"]: s.value for s in families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples}
    assert sum(per_pos.values()) == accepted and per_pos["0"] >= per_pos["3"]
    (base,) = families["loraplex:spec_decode_adapter_accepted_tokens"].samples
    assert base.labels == {"adapter": "_base"} and base.value == accepted


def test_no_speculation_series_when_it_is_off():
    m = Metrics("base", lambda: EngineStats(block_size=16, num_blocks=512), max_lora=None)
    assert "spec_decode" not in m.render().decode()
