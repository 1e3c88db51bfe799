"""Tenants, weights and deadlines through LLMEngine and AsyncEngine on the tiny model."""
from __future__ import annotations

import asyncio

import pytest

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.errors import EngineOverloadedError, InvalidRequestError
from loraplex.engine.errors import TenantShareExceededError
from loraplex.engine.request import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32"),
                                  cache=CacheConfig(block_size=16, num_blocks=64),
                                  scheduler=SchedulerConfig(**kw)))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_a_request_past_its_deadline_finishes_with_timeout_and_frees_everything(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, max_num_seqs=1)
    clock = engine.scheduler.clock = Clock()
    free = engine.kv.pool.num_free_blocks
    slow = engine.add_request([5, 6, 7, 8], _greedy(40), tenant="a", timeout=1.0)
    queued = engine.add_request([5, 6, 7, 9], _greedy(40), tenant="b", timeout=0.5)
    other = engine.add_request([5, 6, 7, 10], _greedy(3), tenant="c")
    outs = [o for _ in range(3) for o in engine.step()]
    assert {o.request_id for o in outs} == {slow} and not any(o.finished for o in outs)
    clock.t += 2.0
    done = {o.request_id: o for o in engine.step() if o.finished}
    assert {rid: (o.finish_reason, o.num_output_tokens) for rid, o in done.items() if rid != other} == {
        slow: ("timeout", 3), queued: ("timeout", 0)}
    assert done[slow].num_prompt_tokens == 4
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.pool.num_free_blocks == free


def test_tenant_share_and_bad_values_are_refused_at_add(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, max_waiting=4, tenant_queue_share=0.25)
    engine.add_request([5, 6], _greedy(2), tenant="t")
    with pytest.raises(TenantShareExceededError):
        engine.add_request([5, 6], _greedy(2), tenant="t")
    engine.add_request([5, 6], _greedy(2), tenant="u", tenant_weight=2.0)
    engine.add_request([5, 6], _greedy(2), tenant="u", tenant_weight=2.0)  # twice the share
    for bad in ({"tenant_weight": 0}, {"tenant_weight": float("nan")}, {"timeout": -1.0},
                {"timeout": float("inf")}, {"tenant": 3}):
        with pytest.raises(InvalidRequestError):
            engine.add_request([5, 6], _greedy(2), **bad)
    assert len(engine.scheduler.waiting) == 3


def test_fcfs_scheduling_holds_no_tenant_to_a_share(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, max_waiting=4, tenant_queue_share=0.25, scheduling="fcfs")
    for _ in range(4):
        engine.add_request([5, 6], _greedy(2), tenant="t")
    with pytest.raises(EngineOverloadedError):  # only the whole queue's size
        engine.add_request([5, 6], _greedy(2), tenant="t")


def test_async_generate_carries_tenant_weight_and_timeout(tiny_llama_dir):
    ae = AsyncEngine(_engine(tiny_llama_dir))

    async def main():
        outs = [o async for o in ae.generate([5, 6, 7], _greedy(50), tenant="a", tenant_weight=3.0,
                                             timeout=1e-9)]
        seen = await ae.call(lambda e: e.scheduler.waiting.counter(1, "a"))
        full = [o async for o in ae.generate([5, 6, 7], _greedy(4), tenant="a", tenant_weight=2.0)]
        counter = await ae.call(lambda e: e.scheduler.waiting.counter(1, "a"))
        return outs, seen, full, counter

    try:
        outs, seen, full, counter = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        ae.shutdown()
    assert [(o.finished, o.finish_reason, o.num_output_tokens) for o in outs] == [(True, "timeout", 0)]
    assert seen == 0
    assert full[-1].finish_reason == "length"
    assert counter == pytest.approx((3 * 1.0 + 4 * 2.0) / 2.0)  # (prompt + 2 x output) / weight


def test_adapter_loads_evictions_and_their_latency_are_counted(tiny_llama_dir, tmp_path):
    from loraplex.adapters import AdapterStore, BaseShapes
    from loraplex.adapters.synth import make_random_peft_adapter
    from loraplex.engine.config import LoRAConfig
    from loraplex.engine.lora import LoRAManager

    store = AdapterStore(tmp_path / "store", BaseShapes.from_model_dir(tiny_llama_dir))
    for i, name in enumerate(("x", "y", "z")):
        store.add(name, make_random_peft_adapter(tiny_llama_dir, tmp_path / name, rank=4, alpha=8, seed=i + 1))
    cfg = EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
                       cache=CacheConfig(block_size=16, num_blocks=64), scheduler=SchedulerConfig(max_num_seqs=1),
                       lora=LoRAConfig(max_loras=2, max_cpu_loras=4, max_lora_rank=8))
    engine = LLMEngine(cfg, LoRAManager(store, cfg.lora))
    # One at a time through two slots: x, y load; z evicts x (least recently used); x again evicts y.
    for name in ("x", "y", "z", "x"):
        (out,) = engine.generate([[5, 6, 7]], _greedy(2), adapter=name)
        assert out.finish_reason == "length"
    assert engine.adapter_loads == {"x": 2, "y": 1, "z": 1}
    assert engine.adapter_evictions == {"x": 1, "y": 1}
    loads = list(engine.recent_adapter_loads)
    assert [(l.seq, l.adapter) for l in loads] == [(1, "x"), (2, "y"), (3, "z"), (4, "x")]
    assert all(l.seconds > 0 for l in loads)
    # Where each adapter is now (what the vllm:lora_adapter_loaded gauge reads): z and x on
    # the device, y evicted to the CPU tier; nothing held by a request.
    res = engine.lora.residency()
    assert {r.name: r.tier for r in res.values()} == {"x": "device", "z": "device", "y": "cpu"}
    assert not any(r.pinned for r in res.values())
    assert sorted(res) == sorted(engine.lora.tiers()["cpu"])


def test_the_first_token_carries_queue_and_prefill_time(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, max_num_seqs=1)
    clock = engine.scheduler.clock = Clock()
    first = engine.add_request([5, 6, 7], _greedy(2))
    second = engine.add_request([5, 6, 8], _greedy(2))
    engine.scheduler.requests[first].arrival_time = engine.scheduler.requests[second].arrival_time = clock.t
    outs = []
    while engine.has_unfinished_requests():
        clock.t += 0.5
        outs += engine.step()
    timed = {o.request_id: (o.queue_time, o.prefill_time) for o in outs if o.queue_time is not None}
    # first: admitted at the first step (0.5 s) and sampled in it; second waits for two steps.
    assert timed == {first: (0.5, 0.0), second: (1.5, 0.0)}
    assert sum(o.queue_time is not None for o in outs) == 2
    assert engine.scheduler.preemptions_by_lane == {lane: 0 for lane in engine.scheduler.preemptions_by_lane}
