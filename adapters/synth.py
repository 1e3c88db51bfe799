"""Make real PEFT adapters with random weights, for tests and benchmarks.

The adapter is written by PEFT itself (`get_peft_model` + `save_pretrained`), so its format is
exactly what users upload. PEFT initialises lora_B to zero (a no-op adapter); A, B and
lora_B's bias (lora_bias=true) are refilled with random values so the adapter visibly
changes the model's output, and DoRA's magnitude vectors (use_dora=true) are perturbed
around their initial column norms, so that the rescale matters too. Saved modules
(modules_to_save) and trainable token rows start as copies of the base weights; they
are perturbed likewise (relative noise), so that serving the base's instead shows.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .shapes import LORA_MODULES


def make_random_peft_adapter(
    base_model_dir: str | Path,
    out_dir: str | Path,
    rank: int = 8,
    alpha: int = 16,
    target_modules: Sequence[str] | str = LORA_MODULES,
    seed: int = 0,
    init_scale: float = 0.05,
    use_rslora: bool = False,
    lora_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write a PEFT LoRA folder for the HF model in `base_model_dir` into `out_dir`.

    `lora_config` passes extra `peft.LoraConfig` fields (rank_pattern, alpha_pattern,
    layers_to_transform, ...). Returns `out_dir`.
    """
    # peft and transformers are test/benchmark dependencies: import them only when called.
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_model_dir), dtype=torch.float32)
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
        **dict(lora_config or {}),
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * init_scale)
            elif ".lora_magnitude_vector." in name or ".modules_to_save." in name or "trainable_tokens_delta" in name:
                param.mul_(1 + torch.randn(param.shape, generator=gen) * init_scale)
    out = Path(out_dir)
    peft_model.save_pretrained(str(out))
    return out
