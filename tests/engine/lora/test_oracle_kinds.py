"""DoRA and lora_bias adapters, saved by real PEFT, give PEFT's greedy tokens in fp32,
mixed in one batch with a plain LoRA adapter and base requests, on the C and torch paths
(the Triton path: tests/engine/kernels/triton/test_engine.py)."""
from __future__ import annotations

import random
import shutil

import pytest

from loraplex.adapters.synth import make_random_peft_adapter
from tests.engine.lora.test_oracle import _engine
from tests.engine.oracle import hf_greedy, run_greedy_with_adapters

# (name, rank, targets, LoraConfig extras): DoRA on every projection and on part of the
# q/k/v group, lora_bias, and a plain adapter beside them.
KINDS = [
    ("dora", 8, None, {"use_dora": True}),
    ("dora_kv", 4, ("k_proj", "v_proj", "down_proj"), {"use_dora": True}),
    ("bias", 8, None, {"lora_bias": True}),
    ("plain", 8, None, {}),
]
# Short prompts decode beside long ones (> 16 rows: the per-segment paths).
LENGTHS = (3, 40, 17, 90, 1, 25, 60, 8, 33, 12)
MAX_TOKENS = (10, 8, 12, 6, 10, 9, 7, 11, 8, 10)
ASSIGN = (None, "dora", "bias", "dora_kv", "plain", "dora", "bias", "dora", "plain", "dora_kv")


def make_kind_adapters(model_dir, root) -> dict:
    return {name: make_random_peft_adapter(model_dir, root / name, rank=rank, alpha=2 * rank, seed=i + 21,
                                           init_scale=0.3, lora_config=extra,
                                           **({"target_modules": t} if t else {}))
            for i, (name, rank, t, extra) in enumerate(KINDS)}


def kind_prompts() -> list[list[int]]:
    rng = random.Random(23)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir"])
def kinds_setup(request, tmp_path_factory):
    """qwen2 has biases on q/k/v: DoRA rescales the base output without its bias."""
    model_dir = request.getfixturevalue(request.param)
    dirs = make_kind_adapters(model_dir, tmp_path_factory.mktemp("kinds"))
    prompts = kind_prompts()
    ref = [hf_greedy(model_dir, [p], [n], adapter_dir=dirs[a] if a else None)[0]
           for p, n, a in zip(prompts, MAX_TOKENS, ASSIGN)]
    return model_dir, dirs, prompts, ref


@pytest.mark.parametrize("setup", [
    dict(kv_bytes=4096 * 4096),  # every adapter and the base requests in one batch
    dict(kernels="torch"),  # grouped bmm for short segments, per-segment matmuls for long ones
    dict(max_loras=2, max_cpu_loras=1, max_num_batched_tokens=24),  # reloads, chunked prefill
], ids=["c-kernel", "torch", "churn"])
def test_kinds_match_peft(tmp_path, kinds_setup, setup):
    model_dir, dirs, prompts, ref = kinds_setup
    engine, _ = _engine(model_dir, tmp_path / "store", dirs, **setup)
    assert run_greedy_with_adapters(engine, prompts, list(ASSIGN), list(MAX_TOKENS)) == ref


def test_the_kinds_matter(tmp_path, kinds_setup):
    """Without its magnitudes (or its biases) each adapter gives other tokens: the oracle
    above would catch an engine that ignored them."""
    import json

    from safetensors.torch import load_file, save_file

    model_dir, dirs, prompts, ref = kinds_setup
    for name, flag, suffix in (("dora", "use_dora", "lora_magnitude_vector"), ("bias", "lora_bias", ".bias")):
        stripped = tmp_path / name
        shutil.copytree(dirs[name], stripped)
        tensors = load_file(stripped / "adapter_model.safetensors")
        save_file({k: v for k, v in tensors.items() if not k.endswith(suffix)}, stripped / "adapter_model.safetensors")
        config = json.loads((stripped / "adapter_config.json").read_text())
        (stripped / "adapter_config.json").write_text(json.dumps(config | {flag: False}))
        rows = [i for i, a in enumerate(ASSIGN) if a == name]
        other = hf_greedy(model_dir, [prompts[i] for i in rows], [MAX_TOKENS[i] for i in rows], adapter_dir=stripped)
        assert other != [ref[i] for i in rows], name
