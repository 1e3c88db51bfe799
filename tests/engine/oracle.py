"""The correctness oracle: transformers' greedy `generate` on the same checkpoint."""
from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(model_dir: Path | str, prompts: list[list[int]], max_tokens: list[int], adapter_dir=None) -> list[list[int]]:
    """Greedy continuations, one prompt at a time (no padding, so nothing can differ)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    # Like ignore_eos: EOS may be generated but does not stop generation. (min_new_tokens
    # would instead forbid EOS, which changes the greedy choice.)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for ids, n in zip(prompts, max_tokens):
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                               do_sample=False, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs
