"""End to end: the engine with the Triton kernels forced (interpreter, CPU tensors) produces
the same greedy tokens as the torch path, on a tiny random Llama with mixed adapters."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("triton", reason="Triton is not installed (pip install triton==3.9.0 --no-deps)")

from loraplex.adapters import AdapterStore, BaseShapes  # noqa: E402
from loraplex.adapters.synth import make_random_peft_adapter  # noqa: E402
from loraplex.engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig  # noqa: E402
from loraplex.engine.engine import LLMEngine  # noqa: E402
from loraplex.engine.kernels.triton.lora import StackedLoRAWeights, TritonLoRABatch  # noqa: E402
from loraplex.engine.lora import LoRAManager  # noqa: E402
from loraplex.engine.request import SamplingParams  # noqa: E402

# (name, rank, targets): ranks 1..64, partial targets.
ADAPTERS = [("r1", 1, None), ("r8", 8, ("q_proj", "v_proj")), ("r64", 64, None),
            ("r16", 16, ("gate_proj", "up_proj", "down_proj", "o_proj"))]
LENGTHS = (5, 37, 1, 19, 12, 50)
MAX_TOKENS = (6, 5, 7, 4, 6, 5)
ASSIGN = (None, "r1", "r8", "r64", "r16", "r64")  # a base request beside adapter requests


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("triton_lora")
    return {name: make_random_peft_adapter(tiny_llama_dir, root / name, rank=rank, alpha=2 * rank, seed=i + 1,
                                           init_scale=0.3, **({"target_modules": t} if t else {}))
            for i, (name, rank, t) in enumerate(ADAPTERS)}


def _generate(model_dir, store_root, dirs, kernels: str, block_size: int) -> tuple[list[list[int]], LLMEngine]:
    store = AdapterStore(store_root, BaseShapes.from_model_dir(model_dir))
    for name, path in dirs.items():
        store.add(name, path)
    cfg = EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32"),
                       cache=CacheConfig(block_size=block_size, num_blocks=64),
                       # a small token budget: prefills are chunked and share steps with decodes
                       scheduler=SchedulerConfig(max_num_batched_tokens=24),
                       lora=LoRAConfig(max_loras=4, max_cpu_loras=4, max_lora_rank=64), kernels=kernels)
    engine = LLMEngine(cfg, LoRAManager(store, cfg.lora))
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in LENGTHS]
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), adapter=a)
           for p, n, a in zip(prompts, MAX_TOKENS, ASSIGN)]
    outs: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.finish_reason != "error", o.stop_reason
            outs[o.request_id] += o.new_token_ids
    return [outs[i] for i in ids], engine


@pytest.mark.parametrize("block_size", [8, 16])
def test_triton_engine_matches_torch(tiny_llama_dir, tmp_path, adapter_dirs, block_size):
    expect, torch_engine = _generate(tiny_llama_dir, tmp_path / "a", adapter_dirs, "torch", block_size)
    got, engine = _generate(tiny_llama_dir, tmp_path / "b", adapter_dirs, "triton", block_size)
    assert torch_engine.runner.backend.name == "torch" and engine.runner.backend.name == "triton"
    assert isinstance(engine.lora.backend, StackedLoRAWeights)
    assert isinstance(engine.lora.batch([(1, 0)]), TritonLoRABatch)
    assert got == expect
    assert all(len(t) == n for t, n in zip(got, MAX_TOKENS))


def test_triton_engine_serves_dora_and_lora_bias_as_peft(tiny_qwen2_dir, tmp_path):
    """DoRA and lora_bias adapters (saved by real PEFT), a plain adapter and base requests
    in one batch: the fused expand epilogue gives PEFT's greedy tokens."""
    from tests.engine.lora.test_oracle_kinds import ASSIGN, MAX_TOKENS, kind_prompts, make_kind_adapters
    from tests.engine.oracle import hf_greedy, run_greedy_with_adapters

    dirs = make_kind_adapters(tiny_qwen2_dir, tmp_path / "kinds")
    prompts = kind_prompts()
    ref = [hf_greedy(tiny_qwen2_dir, [p], [n], adapter_dir=dirs[a] if a else None)[0]
           for p, n, a in zip(prompts, MAX_TOKENS, ASSIGN)]
    store = AdapterStore(tmp_path / "store", BaseShapes.from_model_dir(tiny_qwen2_dir))
    for name, path in dirs.items():
        store.add(name, path)
    cfg = EngineConfig(model=ModelConfig(model=str(tiny_qwen2_dir), dtype="float32"),
                       cache=CacheConfig(block_size=16, num_blocks=128),
                       scheduler=SchedulerConfig(max_num_batched_tokens=64),
                       lora=LoRAConfig(max_loras=4, max_cpu_loras=4, max_lora_rank=16), kernels="triton")
    engine = LLMEngine(cfg, LoRAManager(store, cfg.lora))
    assert isinstance(engine.lora.backend, StackedLoRAWeights)
    assert run_greedy_with_adapters(engine, prompts, list(ASSIGN), list(MAX_TOKENS)) == ref


def test_triton_engine_serves_saved_modules_as_peft(tiny_llama_dir, tmp_path):
    """Trainable tokens, a saved lm_head, saved norms and a saved embedding beside a plain
    adapter and base requests: PEFT's greedy tokens."""
    from tests.engine.lora.test_oracle import _engine
    from tests.engine.lora.test_oracle_saved import ASSIGN, MAX_TOKENS, SAVED, make_saved_adapters, saved_prompts
    from tests.engine.oracle import hf_greedy, run_greedy_with_adapters

    dirs = make_saved_adapters(tiny_llama_dir, tmp_path / "saved", SAVED)
    prompts = saved_prompts()
    ref = [hf_greedy(tiny_llama_dir, [p], [n], adapter_dir=dirs[a] if a else None)[0]
           for p, n, a in zip(prompts, MAX_TOKENS, ASSIGN)]
    engine, _ = _engine(tiny_llama_dir, tmp_path / "store", dirs, kernels="triton", max_loras=4,
                        max_num_batched_tokens=64)
    assert isinstance(engine.lora.backend, StackedLoRAWeights)
    assert run_greedy_with_adapters(engine, prompts, list(ASSIGN), list(MAX_TOKENS)) == ref


def test_triton_engine_serves_mixtures_as_peft_cat(tiny_llama_dir, tmp_path):
    """Mixtures (negative weights, rsLoRA and partial-target components) beside their
    components alone and base requests: PEFT's `add_weighted_adapter(combination_type="cat")`."""
    from tests.engine.lora.test_oracle import _engine
    from tests.engine.lora.test_oracle_mixtures import (ASSIGN, MAX_TOKENS, make_components, mixture_prompts,
                                                        mixture_reference)
    from tests.engine.oracle import run_greedy_with_adapters

    dirs = make_components(tiny_llama_dir, tmp_path / "mix")
    prompts = mixture_prompts()
    ref = [mixture_reference(tiny_llama_dir, dirs, p, n, a) for p, n, a in zip(prompts, MAX_TOKENS, ASSIGN)]
    engine, _ = _engine(tiny_llama_dir, tmp_path / "store", dirs, kernels="triton", max_loras=4,
                        max_num_batched_tokens=64)
    assert isinstance(engine.lora.backend, StackedLoRAWeights)
    assert run_greedy_with_adapters(engine, prompts, ASSIGN, list(MAX_TOKENS)) == ref
