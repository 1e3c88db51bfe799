"""The base model's projection shapes, as LoRA validation needs them.

Llama, Mistral and Qwen2 share one module layout: `model.layers.{i}.self_attn.{q,k,v,o}_proj`
and `model.layers.{i}.mlp.{gate,up,down}_proj`. Everything here assumes that layout.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import AdapterError

# The seven projections loraplex applies LoRA to, in the order they run in a layer.
LORA_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_PARENT: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# Linear modules of the model that loraplex refuses LoRA on, with the reason why.
EMBEDDING_MODULES: tuple[str, ...] = ("embed_tokens", "lm_head")


def module_key(layer: int, module: str) -> str:
    """The module's name in the HF model, which is what PEFT matches its patterns against."""
    return f"model.layers.{layer}.{MODULE_PARENT[module]}.{module}"


def base_module_names(num_layers: int) -> list[str]:
    """Every `named_modules()` name of a Llama-family CausalLM, in model order.

    PEFT matches `target_modules` against all of them, so validation must too: a pattern
    that also hits `lm_head` or a norm is an adapter loraplex cannot serve.
    """
    names = ["model", "model.embed_tokens", "model.layers"]
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        names += [layer, f"{layer}.self_attn"]
        names += [module_key(i, m) for m in LORA_MODULES[:4]]
        names += [f"{layer}.mlp"] + [module_key(i, m) for m in LORA_MODULES[4:]]
        names += [f"{layer}.mlp.act_fn", f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm"]
    names += ["model.norm", "model.rotary_emb", "lm_head"]
    return names


@dataclass(frozen=True)
class BaseShapes:
    """Projection sizes of the base model that every adapter must match."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int  # num_heads * head_dim
    kv_size: int  # num_kv_heads * head_dim
    # What saved modules (modules_to_save, trainable_token_indices) are checked against;
    # 0: unknown, and every saved embedding or lm_head is refused.
    vocab_size: int = 0
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> BaseShapes:
        """Read a Hugging Face `config.json` dict (Llama, Mistral, Qwen2)."""
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            # Some models (Qwen3, Gemma) set head_dim independently of hidden // heads.
            head_dim = int(config.get("head_dim") or hidden // heads)
            return cls(
                num_layers=int(config["num_hidden_layers"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                q_size=heads * head_dim,
                kv_size=kv_heads * head_dim,
                vocab_size=int(config.get("vocab_size") or 0),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise AdapterError(f"base model config lacks {e.args[0]!r}") from None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> BaseShapes:
        """Read `config.json` from a Hugging Face model folder."""
        path = Path(model_dir) / "config.json"
        try:
            return cls.from_hf_config(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            raise AdapterError(f"cannot read base model config {path}: {e}") from None

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of one projection."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        dims = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        return dims[module]
