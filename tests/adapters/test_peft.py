"""PEFT folder loading: real PEFT output loads exactly; every unsupported or broken case is refused."""
from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.adapters import LORA_MODULES, AdapterValidationError, BaseShapes, LoRAAdapter, load_peft_adapter

A0Q = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B1DOWN = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"


def peft_model(base_dir: Path, lora: Path) -> Any:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        return PeftModel.from_pretrained(model, str(lora)).eval()


def peft_layers(model: Any) -> dict[tuple[int, str], Any]:
    """(layer, module) -> PEFT's LoRA layer, for every module PEFT wrapped."""
    out = {}
    for i, layer in enumerate(model.base_model.model.model.layers):
        for name in LORA_MODULES:
            parent = layer.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp
            module = getattr(parent, name)
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                out[(i, name)] = module
    return out


def assert_matches_peft(adapter: LoRAAdapter, model: Any) -> None:
    layers = peft_layers(model)
    assert set(adapter.weights) == set(layers)
    for key, module in layers.items():
        w = adapter.weights[key]
        assert torch.equal(w.a, module.lora_A["default"].weight.detach()), key
        assert torch.equal(w.b, module.lora_B["default"].weight.detach()), key
        assert w.scale == module.scaling["default"], key


def reject(folder: Path, base: BaseShapes, message: str, **kwargs: Any) -> AdapterValidationError:
    with pytest.raises(AdapterValidationError, match=re.escape(message)) as info:
        load_peft_adapter(folder, base, **kwargs)
    assert message in info.value.reason
    return info.value


# ---- valid adapters, checked against PEFT ------------------------------------------------


def test_peft_adapter_loads_exactly_as_peft_sees_it(lora_dir: Path, base_dir: Path, base: BaseShapes) -> None:
    adapter = load_peft_adapter(lora_dir, base)
    assert adapter.digest.startswith("sha256:") and len(adapter.digest) == 7 + 64
    assert adapter.rank == 8 and adapter.alpha == 16.0 and not adapter.use_rslora
    assert adapter.target_modules == LORA_MODULES
    assert len(adapter.weights) == 2 * 7
    assert adapter.weights[(0, "q_proj")].scale == 2.0
    assert adapter.size_bytes == sum(w.a.nbytes + w.b.nbytes for w in adapter.weights.values())
    # synth must have overwritten PEFT's zero init of B, or the adapter would be a no-op.
    assert all(w.b.abs().sum() > 0 for w in adapter.weights.values())
    assert_matches_peft(adapter, peft_model(base_dir, lora_dir))


def test_rslora_scaling(make_adapter: Callable[..., Path], base_dir: Path, base: BaseShapes) -> None:
    lora = make_adapter(rank=4, alpha=8, use_rslora=True)
    adapter = load_peft_adapter(lora, base)
    assert adapter.use_rslora
    assert {w.scale for w in adapter.weights.values()} == {8 / math.sqrt(4)}  # 4.0, not alpha/r = 2.0
    assert_matches_peft(adapter, peft_model(base_dir, lora))


def test_rank_pattern_and_alpha_pattern_scaling(
    make_adapter: Callable[..., Path], base_dir: Path, base: BaseShapes, files: Any
) -> None:
    lora = make_adapter(
        rank=4,
        alpha=8,
        lora_config={
            "rank_pattern": {"q_proj": 2, "model.layers.1.mlp.down_proj": 6},
            "alpha_pattern": {"layers.1.mlp.down_proj": 3, "down_proj": 12},
        },
    )
    adapter = load_peft_adapter(lora, base)
    w = adapter.weights
    assert (w[(0, "q_proj")].rank, w[(0, "q_proj")].scale) == (2, 8 / 2)
    assert (w[(0, "down_proj")].rank, w[(0, "down_proj")].scale) == (4, 12 / 4)
    # Overlapping patterns: the first in *file* order wins, as in PEFT. Before 0.22 PEFT
    # wrote the config with sorted keys ("down_proj", alpha 12, first: it reloaded this
    # adapter with 12 although training used 3); from 0.22 it keeps the patterns' order.
    alpha = {"down_proj": 12, "layers.1.mlp.down_proj": 3}[next(iter(files.read_config(lora)["alpha_pattern"]))]
    assert (w[(1, "down_proj")].rank, w[(1, "down_proj")].scale) == (6, alpha / 6)
    assert (w[(1, "k_proj")].rank, w[(1, "k_proj")].scale) == (4, 8 / 4)
    assert adapter.rank == 6
    model = peft_model(base_dir, lora)
    assert_matches_peft(adapter, model)
    assert_forward_matches(adapter, model, base_dir)


def assert_forward_matches(adapter: LoRAAdapter, model: Any, base_dir: Path) -> None:
    """Base weights + scale * B @ A, merged by hand, give PEFT's logits."""
    from transformers import LlamaForCausalLM

    plain = LlamaForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for (i, name), w in adapter.weights.items():
            layer = plain.model.layers[i]
            parent = layer.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp
            getattr(parent, name).weight += w.scale * (w.b @ w.a)
        ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
        ours, theirs = plain(ids).logits, model(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_layers_to_transform(make_adapter: Callable[..., Path], base_dir: Path, base: BaseShapes) -> None:
    lora = make_adapter(rank=4, target_modules=["q_proj", "v_proj"], lora_config={"layers_to_transform": [1]})
    adapter = load_peft_adapter(lora, base)
    assert set(adapter.weights) == {(1, "q_proj"), (1, "v_proj")}
    assert adapter.target_modules == ("q_proj", "v_proj")
    assert_matches_peft(adapter, peft_model(base_dir, lora))


def test_regex_target_modules(make_adapter: Callable[..., Path], base: BaseShapes) -> None:
    lora = make_adapter(rank=4, target_modules=r".*\.(k_proj|up_proj)")
    assert load_peft_adapter(lora, base).target_modules == ("k_proj", "up_proj")


def test_all_linear(make_adapter: Callable[..., Path], base: BaseShapes, files: Any) -> None:
    lora = make_adapter(rank=4, target_modules="all-linear")
    assert load_peft_adapter(lora, base).target_modules == LORA_MODULES
    files.write_config(lora, target_modules="all-linear")  # unexpanded, as a user may write it
    assert load_peft_adapter(lora, base).target_modules == LORA_MODULES


def test_adapter_name_infix_is_normalized(lora_dir: Path, lora_copy: Path, base: BaseShapes, files: Any) -> None:
    tensors = files.read_tensors(lora_copy)
    files.write_tensors(lora_copy, {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()})
    assert "lora_A.default.weight" in next(iter(files.read_tensors(lora_copy)))
    renamed, original = load_peft_adapter(lora_copy, base), load_peft_adapter(lora_dir, base)
    assert renamed.digest == original.digest
    assert torch.equal(renamed.weights[(1, "up_proj")].b, original.weights[(1, "up_proj")].b)


def test_bf16_load_keeps_the_digest(lora_dir: Path, base: BaseShapes) -> None:
    fp32, bf16 = load_peft_adapter(lora_dir, base), load_peft_adapter(lora_dir, base, torch.bfloat16)
    assert bf16.weights[(0, "o_proj")].a.dtype == torch.bfloat16
    assert bf16.digest == fp32.digest
    assert bf16.size_bytes * 2 == fp32.size_bytes


def test_pickle_next_to_safetensors_is_never_opened(lora_copy: Path, base: BaseShapes) -> None:
    (lora_copy / "adapter_model.bin").write_bytes(b"not a pickle; unpickling this would fail")
    assert load_peft_adapter(lora_copy, base).rank == 8


# ---- refused adapters: one specific message per case ---------------------------------------


def test_bin_only_is_refused(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    torch.save(files.read_tensors(lora_copy), lora_copy / "adapter_model.bin")
    (lora_copy / "adapter_model.safetensors").unlink()
    reject(lora_copy, base, "adapter_model.bin is a pickled checkpoint; only safetensors is accepted")


def test_missing_weights_file(lora_copy: Path, base: BaseShapes) -> None:
    (lora_copy / "adapter_model.safetensors").unlink()
    reject(lora_copy, base, "adapter_model.safetensors is missing")


def test_modules_to_save_of_a_lora_target_is_refused(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    files.write_config(lora_copy, modules_to_save=["q_proj"])
    reject(lora_copy, base, "modules_to_save entry 'q_proj' names model.layers.0.self_attn.q_proj, which is also "
                            "a LoRA target")


def test_embed_tokens_target_is_refused(make_adapter: Callable[..., Path], base: BaseShapes) -> None:
    lora = make_adapter(rank=4, target_modules=["q_proj", "embed_tokens"])
    reject(lora, base, "target module 'embed_tokens' is not supported (LoRA on embeddings/lm_head is not supported)")


def test_lm_head_target_is_refused(make_adapter: Callable[..., Path], base: BaseShapes) -> None:
    lora = make_adapter(rank=4, target_modules=["v_proj", "lm_head"])
    reject(lora, base, "target module 'lm_head' is not supported (LoRA on embeddings/lm_head is not supported)")


def test_regex_reaching_lm_head_is_refused(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    files.write_config(lora_copy, target_modules=r".*(_proj|lm_head)")
    reject(lora_copy, base, "target module 'lm_head' is not supported")


def test_non_projection_target_is_refused(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    files.write_config(lora_copy, target_modules=["mlp"])
    reject(lora_copy, base, "target module 'mlp' (matched by target_modules ['mlp']) is not supported")


def test_wrong_shape(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    tensors = files.read_tensors(lora_copy)
    tensors[A0Q] = torch.zeros(8, 100)
    files.write_tensors(lora_copy, tensors)
    reject(lora_copy, base, f"tensor {A0Q} has shape [8, 100], expected [8, 64]")


def test_rank_in_tensor_disagrees_with_config(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    tensors = files.read_tensors(lora_copy)
    tensors[B1DOWN] = torch.zeros(64, 4)
    files.write_tensors(lora_copy, tensors)
    reject(lora_copy, base, f"tensor {B1DOWN} has shape [64, 4], expected [64, 8]")


def test_unexpected_tensor(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    tensors = files.read_tensors(lora_copy)
    tensors["base_model.model.model.norm.weight"] = torch.ones(64)
    files.write_tensors(lora_copy, tensors)
    reject(lora_copy, base, "unexpected tensor base_model.model.model.norm.weight")


def test_tensor_for_untargeted_module(make_adapter: Callable[..., Path], base: BaseShapes, files: Any) -> None:
    lora = make_adapter(rank=4, target_modules=["q_proj", "k_proj"])
    files.write_config(lora, target_modules=["q_proj"])
    reject(lora, base, "model.layers.0.self_attn.k_proj is not targeted by adapter_config.json")


def test_missing_lora_b(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    tensors = files.read_tensors(lora_copy)
    del tensors[B1DOWN]
    files.write_tensors(lora_copy, tensors)
    reject(lora_copy, base, "missing lora_B for model.layers.1.mlp.down_proj")


def test_rank_over_max_rank(lora_dir: Path, base: BaseShapes) -> None:
    reject(lora_dir, base, "rank 8 (r) exceeds the maximum supported rank 4", max_rank=4)


def test_rank_zero(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    files.write_config(lora_copy, r=0)
    reject(lora_copy, base, "rank 0 (r) is invalid; a rank must be at least 1")


def test_rank_pattern_over_max_rank(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    files.write_config(lora_copy, rank_pattern={"v_proj": 300})
    reject(lora_copy, base, "rank 300 (rank_pattern['v_proj'] for model.layers.0.self_attn.v_proj) exceeds")


def test_non_positive_alpha(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    files.write_config(lora_copy, lora_alpha=0)
    reject(lora_copy, base, "lora_alpha is 0; lora_alpha must be positive")


def test_nan_weight(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    tensors = files.read_tensors(lora_copy)
    tensors[B1DOWN][3, 1] = float("nan")
    files.write_tensors(lora_copy, tensors)
    reject(lora_copy, base, f"tensor {B1DOWN} contains NaN or infinite values")


def test_fp16_overflow(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    tensors = files.read_tensors(lora_copy)
    tensors[A0Q][0, 0] = 1e6  # finite in fp32, inf in fp16
    files.write_tensors(lora_copy, tensors)
    assert load_peft_adapter(lora_copy, base).rank == 8
    reject(lora_copy, base, f"tensor {A0Q} overflows torch.float16", dtype=torch.float16)


def test_bad_json(lora_copy: Path, base: BaseShapes) -> None:
    (lora_copy / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8,')
    reject(lora_copy, base, "adapter_config.json is not valid JSON")


def test_corrupt_safetensors(lora_copy: Path, base: BaseShapes) -> None:
    (lora_copy / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    reject(lora_copy, base, "adapter_model.safetensors is not a valid safetensors file")


def test_non_lora_peft_type(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    files.write_config(lora_copy, peft_type="IA3")
    reject(lora_copy, base, "peft_type is 'IA3'; only LORA adapters are supported")


def test_non_causal_lm_task(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    files.write_config(lora_copy, task_type="SEQ_CLS")
    reject(lora_copy, base, "task_type 'SEQ_CLS' is not supported")


def test_base_rewriting_init(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    files.write_config(lora_copy, init_lora_weights="pissa_niter_4")
    reject(lora_copy, base, "init_lora_weights='pissa_niter_4' rewrites the base weights")


def test_layer_beyond_base_model(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    tensors = files.read_tensors(lora_copy)
    tensors[A0Q.replace("layers.0", "layers.40")] = tensors.pop(A0Q)
    files.write_tensors(lora_copy, tensors)
    reject(lora_copy, base, "layer 40 does not exist in the base model (2 layers)")


def test_layers_to_transform_beyond_base_model(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    files.write_config(lora_copy, layers_to_transform=[0, 7])
    reject(lora_copy, base, "layer 7 does not exist in the base model (2 layers)")


def test_adapter_for_another_architecture(lora_copy: Path, base: BaseShapes, files: Any) -> None:
    files.write_config(lora_copy, target_modules=["c_attn"])
    reject(lora_copy, base, "target module 'c_attn' does not exist in the base model")


def test_missing_folder(tmp_path: Path, base: BaseShapes) -> None:
    reject(tmp_path / "nope", base, "does not exist")


def test_missing_config(lora_copy: Path, base: BaseShapes) -> None:
    (lora_copy / "adapter_config.json").unlink()
    reject(lora_copy, base, "adapter_config.json is missing")
