"""Adapter mixtures give the greedy tokens of PEFT's `add_weighted_adapter(combination_type="cat")`
in fp32, in one batch with their components alone and base requests, on the C and torch
paths (the Triton path: tests/engine/kernels/triton/test_engine.py); each mixture is an
adapter of its own to the prefix cache."""
from __future__ import annotations

import random

import pytest

from loraplex.adapters.synth import make_random_peft_adapter
from loraplex.engine.mixtures import parse_mixture
from tests.engine.lora.test_oracle import _engine
from tests.engine.oracle import hf_greedy, hf_greedy_mixture, run_greedy_with_adapters

# (name, rank, targets, rslora): partial targets (b), rsLoRA scaling (c).
COMPONENTS = [("a", 4, None, False), ("b", 8, ("q_proj", "v_proj", "down_proj"), False), ("c", 2, None, True)]
MIXTURES = ["a*0.7+b*0.3", "a*0.3+b*0.7", "a*0.5+b*-1.5+c*2.0", "b*1.5"]
# The same prompt under a component, two mixtures of it and the base model: a prefix
# cache keyed without the mixture would hand one the others' KV.
SHARED = [0, 0, 0, 0]
ASSIGN = ["a", "a*0.7+b*0.3", "a*0.3+b*0.7", None, "b", "a*0.5+b*-1.5+c*2.0", "c", "b*1.5", "a*0.7+b*0.3", None]
LENGTHS = (40, 40, 40, 40, 17, 60, 3, 25, 90, 8)
MAX_TOKENS = (10, 10, 10, 10, 8, 12, 9, 11, 7, 10)


def mixture_prompts() -> list[list[int]]:
    rng = random.Random(29)
    shared = [rng.randrange(100, 40000) for _ in range(LENGTHS[0])]
    return [shared if i < len(SHARED) else [rng.randrange(100, 40000) for _ in range(n)]
            for i, n in enumerate(LENGTHS)]


def mixture_reference(model_dir, dirs, prompt, n, assign) -> list[int]:
    if assign is None:
        return hf_greedy(model_dir, [prompt], [n])[0]
    if "*" not in assign:
        return hf_greedy(model_dir, [prompt], [n], adapter_dir=dirs[assign])[0]
    return hf_greedy_mixture(model_dir, [prompt], [n], dirs, dict(parse_mixture(assign)))[0]


def make_components(model_dir, root) -> dict:
    return {name: make_random_peft_adapter(model_dir, root / name, rank=rank, alpha=2 * rank, seed=i + 40,
                                           init_scale=0.3, use_rslora=rslora,
                                           **({"target_modules": t} if t else {}))
            for i, (name, rank, t, rslora) in enumerate(COMPONENTS)}


@pytest.fixture(scope="module")
def mix_setup(tiny_llama_dir, tmp_path_factory):
    dirs = make_components(tiny_llama_dir, tmp_path_factory.mktemp("mix"))
    prompts = mixture_prompts()
    ref = [mixture_reference(tiny_llama_dir, dirs, p, n, a) for p, n, a in zip(prompts, MAX_TOKENS, ASSIGN)]
    return tiny_llama_dir, dirs, prompts, ref


@pytest.mark.parametrize("setup", [
    dict(kv_bytes=4096 * 4096),  # every adapter, mixture and base request in one batch
    dict(kernels="torch"),
    dict(max_loras=2, max_cpu_loras=1, max_num_batched_tokens=24),  # reloads, chunked prefill
], ids=["c-kernel", "torch", "churn"])
def test_mixtures_match_peft_cat(tmp_path, mix_setup, setup):
    model_dir, dirs, prompts, ref = mix_setup
    engine, _ = _engine(model_dir, tmp_path / "store", dirs, **setup)
    assert run_greedy_with_adapters(engine, prompts, ASSIGN, list(MAX_TOKENS)) == ref


def test_the_weights_matter(mix_setup):
    """The shared prompt's continuations differ under a component and its mixtures: the
    oracle above would catch an engine that ignored the weights or a component."""
    _, _, _, ref = mix_setup
    assert len({tuple(ref[i]) for i in range(len(SHARED))}) == len(SHARED)


def test_a_mixture_is_an_adapter_of_its_own(tmp_path, mix_setup):
    """Its ref is canonical (order and number form do not matter), its digest is neither
    component's, and a component's new version gives the mixture a new digest."""
    model_dir, dirs, _, _ = mix_setup
    engine, store = _engine(model_dir, tmp_path / "store", dirs)
    mix = engine.lora.ref("b*0.30+a*.7")
    assert mix.name == "a*0.7+b*0.3"
    assert [(c.name, w) for c, w in mix.mixture] == [("a", 0.7), ("b", 0.3)]
    assert mix.digest not in {store.get("a").digest, store.get("b").digest}
    assert engine.lora.ref("a*0.7+b*0.3") == mix
    assert engine.lora.ref("a*0.7+b*0.4").digest != mix.digest
    store.add("b", dirs["c"], replace=True)
    assert engine.lora.ref("a*0.7+b*0.3").digest != mix.digest
