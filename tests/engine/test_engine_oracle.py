"""Greedy output equals transformers' generate, token for token, however the batch runs."""
from __future__ import annotations

import random

import pytest
import torch

from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.request import SamplingParams
from tests.engine.oracle import OracleDrafts, draft_whatever_the_timing, hf_greedy

LENGTHS = (1, 3, 17, 40, 64, 131, 250)
MAX_TOKENS = (9, 24, 5, 30, 16, 12, 20)


def _prompts(seed: int = 0, lengths=LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]


def _engine(model_dir, **kw) -> LLMEngine:
    cache = CacheConfig(block_size=kw.pop("block_size", 16), num_blocks=kw.pop("num_blocks", 256),
                        enable_prefix_caching=kw.pop("prefix", True))
    kernels = kw.pop("kernels", "auto")
    drafts = kw.pop("speculative", 0)
    proposer = kw.pop("proposer", None)
    spec = SpeculativeConfig("ngram", drafts) if drafts else SpeculativeConfig()
    sched = SchedulerConfig(**kw)
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32"), cache=cache,
                                  scheduler=sched, kernels=kernels, speculative=spec), proposer=proposer)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _run(engine: LLMEngine, prompts, max_tokens) -> list[list[int]]:
    outs = engine.generate(prompts, [_greedy(n) for n in max_tokens])
    engine.kv.pool.check_invariants()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks, "a finished request kept blocks"
    return [o.new_token_ids for o in outs]


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama3rope"])
def tiny(request, tiny_llama_dir, tiny_qwen2_dir, tiny_llama3rope_dir):
    d = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "llama3rope": tiny_llama3rope_dir}[request.param]
    return d, hf_greedy(d, _prompts(), list(MAX_TOKENS))


@pytest.mark.parametrize("setup", [
    dict(),  # the whole batch in one step
    dict(max_num_batched_tokens=16, block_size=4),  # chunked prefill across many steps
    dict(max_num_batched_tokens=512, enable_chunked_prefill=False, block_size=8),
    dict(num_blocks=24, block_size=16, max_num_batched_tokens=128),  # forces preemption
    dict(max_num_seqs=2),
    dict(policy="static", max_num_seqs=3),
    # "auto" on a CPU runs decodes through the C kernel; the pure torch path must agree too.
    dict(kernels="torch"),
    dict(kernels="torch", max_num_batched_tokens=16, block_size=4),
    # Speculative decoding: drafts verified beside decodes and prefill chunks, with
    # chunking, with preemption, on the torch path.
    dict(speculative=4),
    dict(speculative=3, max_num_batched_tokens=16, block_size=4),
    dict(speculative=4, num_blocks=20, block_size=16, max_num_batched_tokens=128),
    dict(speculative=5, kernels="torch", block_size=4),
])
def test_tiny_matches_transformers(tiny, setup):
    model_dir, ref = tiny
    if setup.get("speculative"):
        # A random model repeats nothing for prompt lookup to find: drafts come from the
        # reference itself, every third one wrong, so verification keeps some and rejects some.
        setup = {**setup, "proposer": OracleDrafts(_prompts(), ref)}
    engine = _engine(model_dir, **setup)
    if setup.get("speculative"):
        draft_whatever_the_timing(engine)
    assert _run(engine, _prompts(), MAX_TOKENS) == ref
    if setup.get("num_blocks") in (20, 24):
        assert engine.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
    if setup.get("speculative"):
        spec = engine.scheduler.speculation
        assert spec.num_accepted_tokens > 0 and spec.num_draft_tokens > spec.num_accepted_tokens, \
            "drafts were meant to be both accepted and rejected"


def test_prefix_cache_hits_keep_output(tiny_llama_dir):
    rng = random.Random(1)
    shared = [rng.randrange(100, 40000) for _ in range(70)]
    prompts = [shared + [rng.randrange(100, 40000) for _ in range(n)] for n in (1, 5, 33)] + [shared]
    ref = hf_greedy(tiny_llama_dir, prompts, [12] * 4)
    engine = _engine(tiny_llama_dir, block_size=8)
    first = _run(engine, prompts[:1], [12])
    hits_before = engine.kv.num_hits
    assert _run(engine, prompts, [12] * 4) == ref
    assert first == ref[:1]
    assert engine.kv.num_hits - hits_before >= 3 * 64, "later prompts should reuse the shared prefix"


def test_prefix_cache_is_keyed_by_salt(tiny_llama_dir):
    engine = _engine(tiny_llama_dir, block_size=8)
    prompt = _prompts(2, (60,))
    engine.generate(prompt, _greedy(4), cache_salt="tenant-a")
    hits = engine.kv.num_hits
    engine.generate(prompt, _greedy(4), cache_salt="tenant-b")
    assert engine.kv.num_hits == hits, "KV must never be shared across cache salts"
    engine.generate(prompt, _greedy(4), cache_salt="tenant-a")
    assert engine.kv.num_hits > hits


def test_aborts_leave_others_identical(tiny_llama_dir):
    prompts = _prompts(3)
    ref = hf_greedy(tiny_llama_dir, prompts, list(MAX_TOKENS))
    engine = _engine(tiny_llama_dir, max_num_batched_tokens=32, block_size=8)
    keep = [engine.add_request(p, _greedy(n)) for p, n in zip(prompts, MAX_TOKENS)]
    doomed = [engine.add_request(p, _greedy(50)) for p in _prompts(4, (90, 7, 33))]
    outs: dict[str, list[int]] = {r: [] for r in keep}
    step = 0
    while engine.has_unfinished_requests():
        if step in (0, 3, 6):  # abort while waiting, mid-prefill and while decoding
            engine.abort_request(doomed[step // 3])
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    assert [outs[r] for r in keep] == ref
    engine.kv.pool.check_invariants()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_dir):
    rng = random.Random(5)
    from loraplex.engine.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir)
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "List three prime numbers.", "Explain what a LoRA adapter is in one sentence."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    prompts += [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 180)]
    max_tokens = [24, 20, 12, 28, 10, 16]
    ref = hf_greedy(smollm2_dir, prompts, max_tokens)
    # A budget small enough to chunk the prefills and a pool small enough to preempt.
    engine = _engine(smollm2_dir, num_blocks=20, block_size=16, max_num_batched_tokens=48)
    assert _run(engine, prompts, max_tokens) == ref
    assert engine.scheduler.num_preemptions > 0
    # Again with every prompt a prefix-cache hit.
    hits = engine.kv.num_hits
    engine2_out = _run(engine, prompts, max_tokens)
    assert engine2_out == ref
    assert engine.kv.num_hits > hits


def test_warm_up_changes_no_output_and_no_state(tiny_llama_dir):
    # bf16 on torch's layers: the warm-up runs them (fp32 would warm nothing).
    def engine_() -> LLMEngine:
        return LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="bfloat16"),
                                      cache=CacheConfig(num_blocks=256), scheduler=SchedulerConfig(max_num_seqs=4),
                                      kernels="torch"))

    engine = engine_()
    free = engine.kv.pool.num_free_blocks
    assert engine.warm_up() >= 0
    assert engine.kv.pool.num_free_blocks == free and not engine.has_unfinished_requests()
    assert _run(engine, _prompts(), MAX_TOKENS) == _run(engine_(), _prompts(), MAX_TOKENS)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_default_dtype_serves_on_this_cpu(tiny_llama_dir, tmp_path, kernels):
    # bf16 is the default; its kernels (oneDNN packing, C kernels) depend on the CPU's
    # instruction set, and an unsupported one must fall back instead of failing at load.
    from loraplex.adapters import AdapterStore, BaseShapes
    from loraplex.engine.kernels.torch.linear import PackedLinear, WideLinear, packing_supported, widening_supported
    from loraplex.engine.kernels.cpu import gemm as cpu_gemm, linear_choice, lora_choice
    from loraplex.engine.kernels.cpu.backend import c_linear
    from loraplex.engine.kernels.cpu.lora_backend import CLoRABackend
    from loraplex.engine.lora import LoRAManager

    lora = LoRAManager(AdapterStore(tmp_path, BaseShapes.from_model_dir(tiny_llama_dir)))
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir)), kernels=kernels), lora)
    assert engine.runner.dtype is torch.bfloat16
    # The fastest bf16 linear this CPU has: on the "cpu" backend the C kernel (AMX or
    # AVX512-BF16 where the CPU has them, else the AVX2 GEMM), with the fastest oneDNN kernel (packed
    # bf16, or widened to fp32 where bf16 is emulated) from the row count where it
    # measured faster; on the torch backend oneDNN's packed weights where it packs bf16;
    # adapters run on the C LoRA kernel wherever the "cpu" backend does (with oneDNN for
    # long segments from the length where it measured faster).
    proj = type(engine.runner.model.layers[0].qkv_proj)
    cpu = torch.device("cpu")
    cpu_backend = engine.runner.backend.name == "cpu"
    many = [m for m, ok in ((PackedLinear, packing_supported(cpu, torch.bfloat16)),
                            (WideLinear, widening_supported(cpu, torch.bfloat16))) if ok]
    if cpu_backend and cpu_gemm.load_library() is not None:
        few = c_linear()
        choice = linear_choice.choose(few, many) if many else linear_choice.LinearChoice(few, few, None)
        want = {None: few, 1: choice.many}.get(choice.from_rows, linear_choice.SplitLinear)
        assert proj is want and type(engine.runner.model.packed_head) is want
        if want is linear_choice.SplitLinear:  # the measured kernels on each side, from the measured rows
            layer = engine.runner.model.layers[0].qkv_proj
            assert (type(layer.few), type(layer.many), layer.from_rows) == (few, choice.many, choice.from_rows)
    elif packing_supported(cpu, torch.bfloat16):
        assert proj is PackedLinear
    else:
        assert proj is torch.nn.Linear
    assert isinstance(lora.backend, CLoRABackend) == (engine.runner.backend.name == "cpu")
    if cpu_backend:
        assert lora.backend.crossovers is lora_choice.crossovers(torch.bfloat16)
    outs = _run(engine, _prompts(), MAX_TOKENS)
    assert [len(o) for o in outs] == list(MAX_TOKENS)


def test_onednn_primitive_cache_is_sized_for_many_shapes():
    import os

    import loraplex.engine  # noqa: F401  (sets it at import unless the operator did)

    assert int(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]) >= 16384
