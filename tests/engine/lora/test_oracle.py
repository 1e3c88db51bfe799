"""Every request's greedy tokens equal PEFT's for its adapter, whatever shares the batch."""
from __future__ import annotations

import random
import time

import pytest

from loraplex.adapters import AdapterStore, BaseShapes
from loraplex.adapters.synth import make_random_peft_adapter
from loraplex.engine.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig,
                                    SpeculativeConfig)
from loraplex.engine.engine import LLMEngine
from loraplex.engine.errors import UnknownAdapterError
from loraplex.engine.kernels.cpu.lora_backend import CLoRABackend
from loraplex.engine.lora import LoRAManager
from loraplex.engine.request import SamplingParams
from tests.engine.oracle import (OracleDrafts, draft_whatever_the_timing, hf_greedy, run_greedy_with_adapters,
                                schedule_whatever_the_timing)

# (name, rank, targets, rslora): ranks 4..64, partial targets, rsLoRA scaling.
ADAPTERS = [
    ("a4", 4, None, False), ("a8", 8, ("q_proj", "v_proj"), False), ("a16", 16, None, True),
    ("a32", 32, ("gate_proj", "up_proj", "down_proj"), False), ("a64", 64, None, False),
    ("b4", 4, ("o_proj", "k_proj"), False), ("b8", 8, None, False), ("b16", 16, ("down_proj",), False),
    # More than the 8 device slots engines had: adapters are bounded by memory now.
    ("c8", 8, None, False), ("c16", 16, ("q_proj", "k_proj", "v_proj"), False), ("c32", 32, None, True),
    ("c64", 64, ("o_proj", "up_proj"), False),
]
LENGTHS = (3, 40, 17, 90, 1, 25, 60, 8, 33, 120, 12, 47, 5, 70)
MAX_TOKENS = (12, 8, 16, 6, 10, 14, 9, 11, 7, 13, 9, 12, 8, 10)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("lora")
    dirs = {}
    for i, (name, rank, targets, rslora) in enumerate(ADAPTERS):
        kw = {"target_modules": targets} if targets else {}
        dirs[name] = make_random_peft_adapter(tiny_llama_dir, root / name, rank=rank, alpha=2 * rank, seed=i + 1,
                                              init_scale=0.3, use_rslora=rslora, **kw)
    rng = random.Random(11)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in LENGTHS]
    # Requests cycle through the adapters and the base model (None).
    names = [None] + [a[0] for a in ADAPTERS] + [None]
    assign = [names[i % len(names)] for i in range(len(prompts))]
    ref = [hf_greedy(tiny_llama_dir, [p], [n], adapter_dir=dirs[a] if a else None)[0]
           for p, n, a in zip(prompts, MAX_TOKENS, assign)]
    return dirs, prompts, assign, ref


def _engine(model_dir, store_root, dirs, *, max_loras=None, max_cpu_loras=16, kernels="auto", speculative=0,
            proposer=None, **sched):
    store = AdapterStore(store_root, BaseShapes.from_model_dir(model_dir))
    for name, path in dirs.items():
        store.add(name, path)
    kv_bytes = sched.pop("kv_bytes", None)  # a pool sized in bytes: adapters take pages of it
    cache = CacheConfig(block_size=sched.pop("block_size", 8), kv_cache_memory_bytes=kv_bytes,
                        num_blocks=None if kv_bytes else sched.pop("num_blocks", 256))
    model = ModelConfig(model=str(model_dir), dtype="float32", max_model_len=sched.pop("max_model_len", None))
    cfg = EngineConfig(model=model, cache=cache,
                       scheduler=SchedulerConfig(**sched),
                       lora=LoRAConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=64),
                       kernels=kernels, speculative=SpeculativeConfig("ngram", speculative) if speculative else
                       SpeculativeConfig())
    return LLMEngine(cfg, LoRAManager(store, cfg.lora), proposer=proposer), store


def _run(engine, prompts, assign) -> list[list[int]]:
    return run_greedy_with_adapters(engine, prompts, assign, list(MAX_TOKENS))


@pytest.mark.parametrize("setup", [
    dict(kv_bytes=4096 * 4096),  # all 12 adapters and base requests in one batch: memory holds them all
    dict(max_loras=3, max_cpu_loras=2),  # working set exceeds a row cap and the CPU tier
    dict(max_loras=4, num_blocks=30, max_num_batched_tokens=24),  # preemption + chunked prefill
    # adapter pages and KV compete for a small pool
    dict(kv_bytes=200 * 4096, max_model_len=256, max_num_batched_tokens=24),
    dict(kernels="torch"),  # the pure torch path: grouped bmm for short segments, no C kernel
    # Speculative decoding: every request's drafts verified with its own adapter, in one
    # batch with the others' decodes and prefill chunks; with preemption too.
    dict(kv_bytes=4096 * 4096, speculative=4),
    dict(max_loras=4, num_blocks=30, max_num_batched_tokens=24, speculative=3),
    dict(kernels="torch", speculative=4),
])
def test_mixed_adapters_match_peft(tiny_llama_dir, tmp_path, lora_setup, setup):
    dirs, prompts, assign, ref = lora_setup
    if setup.get("speculative"):
        setup = {**setup, "proposer": OracleDrafts(prompts, ref)}
    engine, _ = _engine(tiny_llama_dir, tmp_path / "store", dirs, **setup)
    if setup.get("speculative"):
        draft_whatever_the_timing(engine)
    if setup.get("num_blocks") == 30:
        schedule_whatever_the_timing(engine, dirs)  # so that these always preempt
    assert isinstance(engine.lora.backend, CLoRABackend) == (engine.runner.backend.name == "cpu")
    assert _run(engine, prompts, assign) == ref
    if setup.get("num_blocks") == 30:
        assert engine.scheduler.num_preemptions > 0
    if setup.get("speculative"):
        # Which steps a request drafts in follows when its adapter's background load ends;
        # that drafts of many adapters were verified, some kept and some not, does not.
        by_adapter = engine.scheduler.speculation.by_adapter
        drafted, kept = sum(d for d, _ in by_adapter.values()), sum(a for _, a in by_adapter.values())
        assert len(by_adapter) > 4 and 0 < kept < drafted, by_adapter
    if setup.get("kv_bytes") == 4096 * 4096:
        assert len(engine.scheduler.adapters.resident()) == len(ADAPTERS), "every adapter stays on the device"
    if setup.get("kv_bytes") == 200 * 4096:
        pages = engine._adapter_pages(engine.lora.ref("a64"))
        assert pages > 1 and engine.kv.pool.num_adapter_evictions > 0, "the pool was meant to evict adapters"


def test_adapters_change_the_output(tiny_llama_dir, lora_setup):
    dirs, prompts, assign, ref = lora_setup
    base = hf_greedy(tiny_llama_dir, prompts, list(MAX_TOKENS))
    differs = [r != b for r, b, a in zip(ref, base, assign) if a is not None]
    assert sum(differs) >= len(differs) - 1, "the oracle is meaningless if adapters do nothing"


def test_unknown_adapter_is_refused(tiny_llama_dir, tmp_path, lora_setup):
    engine, _ = _engine(tiny_llama_dir, tmp_path / "store", {})
    with pytest.raises(UnknownAdapterError):
        engine.add_request([1, 2, 3], _greedy(2), adapter="nope")


def test_replaced_adapter_keeps_running_requests_on_old_weights(tiny_llama_dir, tmp_path, lora_setup):
    dirs, prompts, _, _ = lora_setup
    old, new = dirs["a8"], dirs["b8"]  # same rank, different weights
    prompt = prompts[6]
    ref_old = hf_greedy(tiny_llama_dir, [prompt], [20], adapter_dir=old)[0]
    ref_new = hf_greedy(tiny_llama_dir, [prompt], [20], adapter_dir=new)[0]
    assert ref_old != ref_new
    engine, store = _engine(tiny_llama_dir, tmp_path / "store", {"x": old})
    first = engine.add_request(prompt, _greedy(20), adapter="x")
    outs = {first: []}
    for _ in range(3):
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    store.add("x", new, replace=True)  # replaced mid-flight
    second = engine.add_request(prompt, _greedy(20), adapter="x")
    outs[second] = []
    hits = engine.kv.num_hits
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    assert outs[first] == ref_old
    assert outs[second] == ref_new
    assert engine.kv.num_hits == hits, "a prefix-cache hit crossed adapter versions"


def test_broken_adapter_fails_its_request_only(tiny_llama_dir, tmp_path, lora_setup):
    dirs, prompts, _, _ = lora_setup
    engine, store = _engine(tiny_llama_dir, tmp_path / "store", {"x": dirs["a4"]})
    blob = store.path_of(store.get("x").digest)
    for f in blob.glob("*.safetensors"):
        f.write_bytes(b"garbage")  # corrupt it behind the store's back
    bad = engine.add_request(prompts[0], _greedy(4), adapter="x")
    good = engine.add_request(prompts[1], _greedy(4))
    results = {}
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for o in engine.step():
            if o.finished:
                results[o.request_id] = o.finish_reason
        time.sleep(0.01)
    assert results == {bad: "error", good: "length"}


def test_adapter_larger_than_the_pool_fails_its_request_only(tiny_llama_dir, tmp_path, lora_setup):
    dirs, prompts, _, _ = lora_setup
    # 100 blocks of 4 KiB; a64's weights need 128 of them: it can never be resident.
    engine, _ = _engine(tiny_llama_dir, tmp_path / "store", {"big": dirs["a64"], "small": dirs["a4"]},
                        kv_bytes=100 * 4096, max_model_len=256)
    ids = {engine.add_request(prompts[0], _greedy(4), adapter=a): a for a in ("big", "small", None)}
    results = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for o in engine.step():
            if o.finished:
                results[ids[o.request_id]] = (o.finish_reason, o.stop_reason)
        time.sleep(0.005)
    assert results["big"][0] == "error" and "blocks" in results["big"][1]
    assert results["small"][0] == results[None][0] == "length"
