"""Content digest: equal content hashes equal, any change that matters hashes differently."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from loraplex.adapters import BaseShapes, adapter_digest, load_peft_adapter

CONFIG: dict[str, Any] = {
    "peft_type": "LORA",
    "r": 4,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "v_proj", "down_proj"],
    "base_model_name_or_path": "/somewhere/base",
    "peft_version": "0.21.2",
    "lora_dropout": 0.05,
}


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "m.lora_A.weight": torch.randn(4, 16, generator=g),
        "m.lora_B.weight": torch.randn(8, 4, generator=g),
    }


def test_format_and_determinism() -> None:
    d = adapter_digest(CONFIG, tensors())
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", d)
    assert adapter_digest(dict(CONFIG), tensors()) == d


def test_key_order_and_irrelevant_fields_do_not_matter() -> None:
    d = adapter_digest(CONFIG, tensors())
    reordered = dict(reversed(list(CONFIG.items())))
    reordered["target_modules"] = ["down_proj", "q_proj", "v_proj"]  # PEFT saves a set
    reordered.update(base_model_name_or_path="/elsewhere", peft_version="0.17.0", lora_dropout=0.0)
    reordered["lora_alpha"] = 8.0
    reordered["use_rslora"] = False  # explicit default
    tensors_reordered = dict(reversed(list(tensors().items())))
    assert adapter_digest(reordered, tensors_reordered) == d


def test_any_weight_change_changes_the_digest() -> None:
    d = adapter_digest(CONFIG, tensors())
    changed = tensors()
    changed["m.lora_B.weight"][7, 3] += 1e-6
    assert adapter_digest(CONFIG, changed) != d
    assert adapter_digest(CONFIG, tensors(seed=1)) != d


def test_dtype_shape_and_name_are_part_of_the_content() -> None:
    base = tensors()
    d = adapter_digest(CONFIG, base)
    as_bf16 = {k: v.to(torch.bfloat16) for k, v in base.items()}
    reshaped = {**base, "m.lora_A.weight": base["m.lora_A.weight"].reshape(8, 8)}  # same bytes
    renamed = {"n.lora_A.weight": base["m.lora_A.weight"], "m.lora_B.weight": base["m.lora_B.weight"]}
    digests = {adapter_digest(CONFIG, t) for t in (as_bf16, reshaped, renamed)}
    assert d not in digests and len(digests) == 3


def test_lora_relevant_config_changes_the_digest() -> None:
    d = adapter_digest(CONFIG, tensors())
    for change in (
        {"lora_alpha": 16},
        {"use_rslora": True},
        {"r": 8},
        {"target_modules": ["q_proj", "v_proj"]},
        {"alpha_pattern": {"q_proj": 2}},
        {"rank_pattern": {"q_proj": 2}},
        {"layers_to_transform": [0]},
        {"exclude_modules": ["q_proj"]},
    ):
        assert adapter_digest({**CONFIG, **change}, tensors()) != d, change


def test_pattern_order_is_kept() -> None:
    # The first matching pattern wins in PEFT, so the order of patterns is content.
    a = {**CONFIG, "alpha_pattern": {"down_proj": 2, "layers.1.mlp.down_proj": 3}}
    b = {**CONFIG, "alpha_pattern": {"layers.1.mlp.down_proj": 3, "down_proj": 2}}
    assert adapter_digest(a, tensors()) != adapter_digest(b, tensors())


def test_bf16_tensors_hash_by_their_bytes() -> None:
    t = {"w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16)}
    u = {"w": torch.tensor([1.0, 2.015625], dtype=torch.bfloat16)}
    assert adapter_digest(CONFIG, t) != adapter_digest(CONFIG, u)


def test_rewritten_files_keep_the_digest(lora_dir: Path, lora_copy: Path, base: BaseShapes) -> None:
    config_path = lora_copy / "adapter_config.json"
    raw = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(dict(reversed(list(raw.items()))), indent=4))
    os.utime(lora_copy / "adapter_model.safetensors", (1_000_000, 1_000_000))
    assert load_peft_adapter(lora_copy, base).digest == load_peft_adapter(lora_dir, base).digest


def test_loaded_digest_changes_with_one_weight(lora_dir: Path, lora_copy: Path, base: BaseShapes, files: Any) -> None:
    t = files.read_tensors(lora_copy)
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    t[name][0, 0] = t[name][0, 0] * 1.0001
    files.write_tensors(lora_copy, t)
    assert load_peft_adapter(lora_copy, base).digest != load_peft_adapter(lora_dir, base).digest
