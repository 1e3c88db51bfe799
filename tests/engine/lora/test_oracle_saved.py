"""Adapters with saved modules (trainable_token_indices, modules_to_save: embed_tokens,
lm_head, the norms), saved by real PEFT, give PEFT's greedy tokens in fp32, mixed in one
batch with plain LoRA adapters and base requests, on the C and torch paths (the Triton
path: tests/engine/kernels/triton/test_engine.py)."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.adapters.synth import make_random_peft_adapter
from tests.engine.lora.test_oracle import _engine
from tests.engine.oracle import hf_greedy, run_greedy_with_adapters

# Token ids the trainable-token adapters retrain; the prompts below contain them.
TOKENS = [5, 100, 2000, 31337]
# (name, targets, LoraConfig extras)
SAVED = [
    ("tokens", ("q_proj", "v_proj"), {"trainable_token_indices": TOKENS}),
    ("head", ("o_proj",), {"modules_to_save": ["lm_head"]}),
    ("norms", None, {"modules_to_save": ["input_layernorm", "post_attention_layernorm", "norm"]}),
    ("embed", ("down_proj",), {"modules_to_save": ["embed_tokens", "input_layernorm"]}),
    ("plain", None, {}),
]
LENGTHS = (3, 40, 17, 90, 1, 25, 60, 8, 33, 12, 21)
MAX_TOKENS = (10, 8, 12, 6, 10, 9, 7, 11, 8, 10, 9)
ASSIGN = (None, "tokens", "head", "norms", "embed", "plain", "tokens", "head", "embed", "norms", "tokens")


def saved_prompts() -> list[list[int]]:
    rng = random.Random(29)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in LENGTHS]
    for p in prompts:  # every prompt meets the retrained tokens, at its start and its end
        p[:0], p[-1:] = TOKENS[:2], [TOKENS[2]]
    return prompts


def make_saved_adapters(model_dir, root, spec) -> dict:
    return {name: make_random_peft_adapter(model_dir, root / name, rank=8, alpha=16, seed=i + 41, init_scale=0.3,
                                           lora_config=extra, **({"target_modules": t} if t else {}))
            for i, (name, t, extra) in enumerate(spec)}


@pytest.fixture(scope="module")
def saved_setup(tmp_path_factory, tiny_llama_dir):
    dirs = make_saved_adapters(tiny_llama_dir, tmp_path_factory.mktemp("saved"), SAVED)
    prompts = saved_prompts()
    ref = [hf_greedy(tiny_llama_dir, [p], [n], adapter_dir=dirs[a] if a else None)[0]
           for p, n, a in zip(prompts, MAX_TOKENS, ASSIGN)]
    return dirs, prompts, ref


@pytest.mark.parametrize("setup", [
    dict(kv_bytes=4096 * 4096),  # every adapter and the base requests in one batch
    dict(kernels="torch"),
    dict(max_loras=2, max_cpu_loras=1, max_num_batched_tokens=24),  # slot reuse, chunked prefill
], ids=["c-kernel", "torch", "churn"])
def test_saved_modules_match_peft(tmp_path, tiny_llama_dir, saved_setup, setup):
    dirs, prompts, ref = saved_setup
    engine, _ = _engine(tiny_llama_dir, tmp_path / "store", dirs, **setup)
    assert run_greedy_with_adapters(engine, prompts, list(ASSIGN), list(MAX_TOKENS)) == ref


def _strip(folder, to, field: str):
    """A copy of `folder` without `field` in its config and without the tensors it saved."""
    shutil.copytree(folder, to)
    tensors = load_file(to / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".lora_" in k}, to / "adapter_model.safetensors")
    config = json.loads((to / "adapter_config.json").read_text())
    (to / "adapter_config.json").write_text(json.dumps(config | {field: None}))
    return to


def test_the_saved_modules_matter(tmp_path, tiny_llama_dir, saved_setup):
    """Without its saved modules each adapter gives other tokens: the oracle above would
    catch an engine that served the base embedding, norms or head instead."""
    dirs, prompts, ref = saved_setup
    for name, _, extra in SAVED[:-1]:
        stripped = _strip(dirs[name], tmp_path / name, next(iter(extra)))
        rows = [i for i, a in enumerate(ASSIGN) if a == name]
        other = hf_greedy(tiny_llama_dir, [prompts[i] for i in rows], [MAX_TOKENS[i] for i in rows],
                          adapter_dir=stripped)
        assert other != [ref[i] for i in rows], name


def test_tied_head_shares_the_trainable_token_rows(tmp_path, tiny_qwen2_dir):
    """On a base with tied embeddings PEFT ties the lm_head to the embedding's retrained rows:
    those tokens' logits use them too. The rows are scaled up here so that they win."""
    spec = [("tokens", None, {"trainable_token_indices": TOKENS}), ("plain", None, {})]
    dirs = make_saved_adapters(tiny_qwen2_dir, tmp_path / "adapters", spec)
    weights = dirs["tokens"] / "adapter_model.safetensors"
    tensors = load_file(weights)
    name = next(k for k in tensors if k.endswith("trainable_tokens_delta"))
    tensors[name] = tensors[name] * torch.tensor([4.0, 1.0, 3.0, 1.0])[:, None]
    save_file(tensors, weights)
    prompts, assign, n = saved_prompts()[:4], ["tokens", None, "plain", "tokens"], [6, 6, 6, 6]
    ref = [hf_greedy(tiny_qwen2_dir, [p], [k], adapter_dir=dirs[a] if a else None)[0]
           for p, k, a in zip(prompts, n, assign)]
    assert any(t in TOKENS for t in ref[0] + ref[3])  # the retrained head rows decide
    engine, _ = _engine(tiny_qwen2_dir, tmp_path / "store", dirs, kv_bytes=4096 * 4096)
    assert run_greedy_with_adapters(engine, prompts, assign, n) == ref
