from __future__ import annotations

import pytest

from loraplex.platform.routing import Residency, StatsError, WorkerStats, prefix_key


def test_stats_round_trip_through_json():
    stats = WorkerStats(ready=True, draining=False, running=3, waiting={"interactive": 1, "batch": 4},
                        kv_usage=0.5, device_adapters=frozenset({"a", "b"}), cpu_adapters=frozenset({"c"}),
                        max_loras=8, prefix_keys=("k1", "k2"))
    assert WorkerStats.from_json(stats.to_json()) == stats
    assert stats.waiting_total == 5
    assert [stats.residency(a) for a in "abcd"] == [Residency.DEVICE, Residency.DEVICE, Residency.CPU,
                                                     Residency.ABSENT]


def test_stats_defaults_and_unknown_keys():
    assert WorkerStats.from_json({"future_field": 1}) == WorkerStats()


@pytest.mark.parametrize("doc, field", [
    ([], "object"), ({"running": -1}, "running"), ({"running": True}, "running"),
    ({"kv_usage": 1.5}, "kv_usage"), ({"kv_usage": "x"}, "kv_usage"), ({"ready": "yes"}, "ready"),
    ({"waiting": {"batch": -2}}, "waiting"), ({"waiting": [1]}, "waiting"),
    ({"device_adapters": "a"}, "device_adapters"), ({"prefix_keys": [1]}, "prefix_keys"),
])
def test_bad_stats_name_the_field(doc, field):
    with pytest.raises(StatsError, match=field):
        WorkerStats.from_json(doc)


def test_prefix_key_depends_on_salt_adapter_and_leading_blocks():
    ids = list(range(100))
    key = prefix_key("tenant-1", "ad", ids, block_size=16, n_blocks=2)
    assert key == prefix_key("tenant-1", "ad", ids[:32] + [7] * 50, block_size=16, n_blocks=2)
    assert key != prefix_key("tenant-2", "ad", ids, block_size=16, n_blocks=2)
    assert key != prefix_key("tenant-1", None, ids, block_size=16, n_blocks=2)
    assert key != prefix_key("tenant-1", "ad", [99] + ids[1:], block_size=16, n_blocks=2)
    assert prefix_key("tenant-1", "ad", ids[:15], block_size=16) is None  # no full block


def test_stats_from_a_real_engine(tiny_llama_dir):
    import dataclasses

    from loraplex.engine.client import AdapterResidency
    from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig
    from loraplex.engine.engine import LLMEngine
    from loraplex.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
                                    cache=CacheConfig(block_size=16, num_blocks=64)))
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=4), lane="batch")
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    def with_adapters(stats):  # this engine serves none: give it a residency to report
        return dataclasses.replace(stats, adapters=AdapterResidency(("d1",), ("c1",)), max_loras=4)

    queued = WorkerStats.from_engine(with_adapters(engine.stats()))
    assert (queued.running, queued.waiting["batch"], queued.waiting_total) == (0, 1, 2)
    engine.step()
    stats = WorkerStats.from_engine(with_adapters(engine.stats()), draining=True)
    assert stats.running == 2 and stats.waiting_total == 0 and 0.0 < stats.kv_usage <= 1.0
    assert stats.residency("d1") == Residency.DEVICE and stats.residency("c1") == Residency.CPU
    assert stats.draining and WorkerStats.from_json(stats.to_json()) == stats
