"""Tiny random llama-family checkpoints with SmolLM2's real tokenizer, for fast tests.

They are saved exactly as transformers saves real models (safetensors + config.json +
tokenizer files), so the engine loads them through its normal path and transformers
can serve as the reference on the same folder.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TINY_ARCHS = ("llama", "qwen2", "llama3rope")
# Files that make up a tokenizer in a Hugging Face folder (whichever of them exist).
_TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "chat_template*", "vocab.json", "merges.txt")


def _config(arch: str, vocab_size: int, special: dict[str, int]):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        **special,
    )
    if arch == "llama":
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        return LlamaConfig(tie_word_embeddings=False, rope_parameters=rope, **common)
    if arch == "llama3rope":
        # original_max_position_embeddings is small so that, with head_dim 16, the
        # frequencies fall in all three llama3 bands (kept, blended, divided by factor).
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
        return LlamaConfig(tie_word_embeddings=False, rope_parameters=rope, **common)
    if arch == "qwen2":
        return Qwen2Config(
            tie_word_embeddings=True,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            **common,
        )
    raise ValueError(f"unknown tiny arch {arch!r}; use one of {TINY_ARCHS}")


def _perturb(model: torch.nn.Module, seed: int) -> None:
    # transformers initialises biases to zero and norm weights to one; an engine that
    # ignored either would still match the reference, so give them random values.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
            elif "norm" in name:
                param.copy_(1.0 + torch.randn(param.shape, generator=gen) * 0.1)


def build_tiny_model_dir(
    out_dir: str | Path, arch: str = "llama", seed: int = 0, tokenizer_dir: str | Path | None = None
) -> Path:
    """Save a random tiny `arch` model (float32) plus the SmolLM2 tokenizer into out_dir.

    tokenizer_dir defaults to the converted embedded SmolLM2 folder.
    """
    from transformers import AutoModelForCausalLM

    if tokenizer_dir is None:
        from loraplex.engine.checkpoint import resolve_model_dir

        tokenizer_dir = resolve_model_dir("default")
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    source = json.loads((tokenizer_dir / "config.json").read_text())
    special = {k: source[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if source.get(k) is not None}
    config = _config(arch, int(source["vocab_size"]), special)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb(model, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for pattern in _TOKENIZER_GLOBS:
        for file in tokenizer_dir.glob(pattern):
            shutil.copy2(file, out_dir / file.name)
    return out_dir
