"""SmolLM2 with trained and random adapters in one batch: every request equals PEFT's output."""
from __future__ import annotations

import random

import pytest

from loraplex.adapters import AdapterStore, BaseShapes
from loraplex.adapters.demo import ensure_demo_adapters
from loraplex.adapters.synth import make_random_peft_adapter
from loraplex.engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.lora import LoRAManager
from loraplex.engine.request import SamplingParams
from loraplex.engine.tokenizer import Tokenizer
from tests.engine.oracle import hf_greedy, run_greedy_with_adapters, schedule_whatever_the_timing

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of Japan?", "How can I improve my writing?", "Tell me about the ocean.",
             "Write a haiku about the sea.", "List three prime numbers.", "What is the best way to cook pasta?",
             "Explain what a LoRA adapter is in one sentence.", "Why do birds sing?"]
# One request per row: (prompt: question index or a random-token length, adapter or None, max tokens).
REQUESTS = [(0, None, 16), (1, "pirate", 20), (2, "terse", 12), (3, "r4", 18), (4, "r32", 14),
            (5, "pirate", 16), (6, None, 12), (7, "r32", 10), ("r150", "terse", 14), ("r60", "r4", 12)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(smollm2_dir, tmp_path_factory):
    dirs = dict(ensure_demo_adapters(smollm2_dir))  # trained once per machine, then cached
    root = tmp_path_factory.mktemp("smollm2-lora")
    # Random weights, small enough that the text stays sane but large enough to change it.
    dirs["r4"] = make_random_peft_adapter(smollm2_dir, root / "r4", rank=4, alpha=8, seed=4, init_scale=0.03)
    dirs["r32"] = make_random_peft_adapter(smollm2_dir, root / "r32", rank=32, alpha=32, seed=32, init_scale=0.02,
                                           target_modules=("q_proj", "v_proj", "o_proj", "down_proj"),
                                           use_rslora=True)
    tok = Tokenizer(smollm2_dir)
    rng = random.Random(3)
    prompts = [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[p]}]) if isinstance(p, int)
               else [rng.randrange(100, 40000) for _ in range(int(p[1:]))] for p, _, _ in REQUESTS]
    assign = [a for _, a, _ in REQUESTS]
    max_tokens = [n for _, _, n in REQUESTS]
    # The oracle, one model per adapter: transformers + PEFT, one prompt at a time.
    ref: list[list[int] | None] = [None] * len(REQUESTS)
    for adapter in dict.fromkeys(assign):
        rows = [i for i, a in enumerate(assign) if a == adapter]
        outs = hf_greedy(smollm2_dir, [prompts[i] for i in rows], [max_tokens[i] for i in rows],
                         adapter_dir=dirs[adapter] if adapter else None)
        for i, out in zip(rows, outs):
            ref[i] = out
    base = hf_greedy(smollm2_dir, prompts, max_tokens)
    return dirs, prompts, assign, max_tokens, ref, base


def _engine(model_dir, store_root, dirs, *, max_loras=4, max_cpu_loras=4, num_blocks=256, block_size=16, **sched):
    store = AdapterStore(store_root, BaseShapes.from_model_dir(model_dir))
    for name, path in dirs.items():
        store.add(name, path)
    cfg = EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32"),
                       cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                       scheduler=SchedulerConfig(**sched),
                       lora=LoRAConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=64))
    return LLMEngine(cfg, LoRAManager(store, cfg.lora))


def _run(engine, prompts, assign, max_tokens) -> list[list[int]]:
    return run_greedy_with_adapters(engine, prompts, assign, max_tokens)


def test_adapters_change_the_output(setup):
    """The oracle means nothing if an adapter leaves the greedy tokens as they were."""
    _, _, assign, _, ref, base = setup
    changed = {a for a, r, b in zip(assign, ref, base) if a is not None and r != b}
    assert changed == {a for a in assign if a is not None}


def test_one_batch_of_mixed_adapters_matches_peft(smollm2_dir, tmp_path, setup):
    dirs, prompts, assign, max_tokens, ref, _ = setup
    engine = _engine(smollm2_dir, tmp_path / "store", dirs)
    assert _run(engine, prompts, assign, max_tokens) == ref


def test_preemption_and_chunked_prefill_match_peft(smollm2_dir, tmp_path, setup):
    dirs, prompts, assign, max_tokens, ref, _ = setup
    # 48 tokens a step chunks every prefill (prompts are 30-150 tokens); 12 blocks of 16
    # cannot hold the running requests' KV, so requests are preempted and recomputed.
    # Two device slots for four adapters: adapters also rotate through the slots.
    engine = _engine(smollm2_dir, tmp_path / "store", dirs, max_loras=2, max_cpu_loras=2,
                     num_blocks=12, max_num_batched_tokens=48)
    schedule_whatever_the_timing(engine)  # aging by steps (a two-adapter CPU tier cannot hold all four)
    assert _run(engine, prompts, assign, max_tokens) == ref
    assert engine.scheduler.num_preemptions > 0, "the small KV pool was meant to force preemption"
