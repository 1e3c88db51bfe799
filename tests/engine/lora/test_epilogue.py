"""DoRA's and lora_bias's per-feature epilogues (engine/lora/epilogue.py): computed once
at load exactly as PEFT computes them, carried with the packed weights, refused clearly
when they cannot be computed."""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from loraplex.adapters import AdapterStore, BaseShapes, load_peft_adapter
from loraplex.adapters.synth import make_random_peft_adapter
from loraplex.engine.checkpoint import ModelArch
from loraplex.engine.lora import LoRAManager, pack_adapter
from loraplex.engine.lora.epilogue import AdapterLoadError, CheckpointWeights, module_epilogues
from loraplex.engine.lora.packing import projection_sizes
from loraplex.engine.lora.staging import map_packed


def _peft_layers(model_dir, adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    for i, layer in enumerate(model.base_model.model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, module in parent.named_children():
                if hasattr(module, "lora_A") and "default" in module.lora_A:
                    yield (i, name), module


@pytest.mark.parametrize("extra", [{"use_dora": True}, {"lora_bias": True}], ids=["dora", "lora_bias"])
def test_epilogues_are_peft_s(tiny_qwen2_dir, tmp_path, extra):
    """Applied to the base output plus the LoRA delta, the epilogue gives the output of
    PEFT's layer (qwen2: q/k/v have a base bias, which DoRA leaves unscaled)."""
    lora = make_random_peft_adapter(tiny_qwen2_dir, tmp_path / "a", rank=4, alpha=8, seed=5, init_scale=0.3,
                                    lora_config=extra)
    adapter = load_peft_adapter(lora, BaseShapes.from_model_dir(tiny_qwen2_dir))
    epilogues = module_epilogues(adapter, CheckpointWeights(tiny_qwen2_dir, torch.float32))
    assert set(epilogues) == set(adapter.weights)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    checked = 0
    for key, module in _peft_layers(tiny_qwen2_dir, lora):
        w, (scale, shift) = adapter.weights[key], epilogues[key]
        assert (scale is not None) == ("use_dora" in extra)
        xin = x if module.in_features == 64 else torch.randn(5, module.in_features)
        with torch.no_grad():
            want = module(xin)
            ours = module.base_layer(xin) + (xin @ w.a.T @ w.b.T) * w.scale
        ours = ours * (1 if scale is None else scale) + (0 if shift is None else shift)
        torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
        checked += 1
    assert checked == len(adapter.weights) == 14


def test_epilogues_travel_with_the_packed_weights(tiny_qwen2_dir, tmp_path):
    lora = make_random_peft_adapter(tiny_qwen2_dir, tmp_path / "a", rank=4, target_modules=["k_proj", "o_proj"],
                                    lora_config={"use_dora": True})
    adapter = load_peft_adapter(lora, BaseShapes.from_model_dir(tiny_qwen2_dir))
    epilogues = module_epilogues(adapter, CheckpointWeights(tiny_qwen2_dir, torch.float32))
    _, out_sizes = projection_sizes(ModelArch.from_dir(tiny_qwen2_dir))
    packed = pack_adapter(adapter, out_sizes, 2, torch.float32, torch.device("cpu"), epilogues)
    qkv = packed[0]["qkv"]
    q, kv = out_sizes["q_proj"], out_sizes["k_proj"]
    assert torch.equal(qkv.scale[q:q + kv], epilogues[(0, "k_proj")][0])
    assert torch.equal(qkv.scale[:q], torch.ones(q)) and torch.equal(qkv.scale[q + kv:], torch.ones(kv))
    assert torch.equal(qkv.shift[q:q + kv], epilogues[(0, "k_proj")][1]) and not qkv.shift[:q].any()
    assert packed[1]["o"].shift is None  # o_proj has no base bias: DoRA scales only
    copied = map_packed(packed, torch.clone)  # what staging does on its way to the device
    assert torch.equal(copied[0]["qkv"].scale, qkv.scale) and torch.equal(copied[0]["qkv"].shift, qkv.shift)
    with pytest.raises(ValueError, match="needs its epilogue"):
        pack_adapter(adapter, out_sizes, 2, torch.float32, torch.device("cpu"))


def test_dora_without_base_weights_fails_its_load(tiny_llama_dir, tmp_path):
    lora = make_random_peft_adapter(tiny_llama_dir, tmp_path / "a", rank=4, lora_config={"use_dora": True})
    store = AdapterStore(tmp_path / "store", BaseShapes.from_model_dir(tiny_llama_dir))
    record = store.add("dora", lora)
    manager = LoRAManager(store)
    manager.bind(ModelArch.from_dir(tiny_llama_dir), torch.float32, torch.device("cpu"))
    with pytest.raises(AdapterLoadError, match="DoRA adapters need the base model's weights"):
        manager.prefetch(record.digest).result(timeout=60)
    assert "base model's weights" in manager.failed()[record.digest]
    manager.close()


def test_zero_column_norm_is_refused():
    w = SimpleNamespace(a=torch.zeros(2, 4), b=torch.zeros(3, 2), scale=1.0, bias=None, magnitude=torch.ones(3))
    with pytest.raises(AdapterLoadError, match="not finite"):
        module_epilogues(SimpleNamespace(weights={(0, "o_proj"): w}), lambda layer, m: (torch.zeros(3, 4), None))
