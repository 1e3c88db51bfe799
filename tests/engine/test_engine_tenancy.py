"""Tenants, weights and deadlines through LLMEngine and AsyncEngine on the tiny model."""
from __future__ import annotations

import asyncio

import pytest

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.errors import EngineOverloadedError, InvalidRequestError
from loraplex.engine.fairness import TenantShareExceededError
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
