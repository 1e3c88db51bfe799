"""An adapter's kind: the PEFT features it uses beyond plain LoRA, as short tags.

This is the one definition of the concept: the store records the tags with each version,
the platform's registry with each adapter row, and the admin API and UI show them. The
tags are read off the validated adapter (what is served), in this order:

- ``rslora``: `use_rslora` (each module's scale is alpha / sqrt(rank))
- ``dora``: `use_dora` (a `lora_magnitude_vector` per target)
- ``lora_bias``: `lora_bias` (a bias on every lora_B)
- ``trainable_tokens:<modules>``: `trainable_token_indices`; the modules whose rows it
  replaces (`embed_tokens`, and `lm_head` too when the head has rows, its own or, on a
  base with tied embeddings, the embedding's)
- ``modules_to_save:<modules>``: the modules saved whole (`embed_tokens`,
  `input_layernorm`, `post_attention_layernorm`, `norm`, `lm_head`), each named once by
  its own name whatever layers it covers

`<modules>` is comma-separated, in model order. No tags: plain LoRA. Where a kind is not
known (a version recorded before kinds were), callers hold None, never an empty tuple.
"""
from __future__ import annotations

from .peft import LoRAAdapter
from .peft_saved import LAYER_NORMS, SavedModules

RSLORA, DORA, LORA_BIAS = "rslora", "dora", "lora_bias"
TRAINABLE_TOKENS, MODULES_TO_SAVE = "trainable_tokens", "modules_to_save"
# Every feature a tag may name, in tag order (the part before ':').
FEATURES: tuple[str, ...] = (RSLORA, DORA, LORA_BIAS, TRAINABLE_TOKENS, MODULES_TO_SAVE)
# A regular expression every tag matches (the admin API's schema publishes it).
TAG_PATTERN = (rf"^({RSLORA}|{DORA}|{LORA_BIAS}|({TRAINABLE_TOKENS}|{MODULES_TO_SAVE}):"
               r"[a-z_]+(,[a-z_]+)*)$")


def adapter_features(adapter: LoRAAdapter) -> tuple[str, ...]:
    """The adapter's kind tags (see the module's docstring); () for plain LoRA."""
    weights = adapter.weights.values()
    tags = [tag for tag, has in ((RSLORA, adapter.use_rslora),
                                 (DORA, any(w.magnitude is not None for w in weights)),
                                 (LORA_BIAS, any(w.bias is not None for w in weights))) if has]
    if adapter.saved is not None:
        tags += _saved_tags(adapter.saved)
    return tuple(tags)


def _saved_tags(saved: SavedModules) -> list[str]:
    rows = [m for m, has in (("embed_tokens", saved.embed_rows), ("lm_head", saved.head_rows)) if has is not None]
    norms = {name for _, name in saved.norms}
    whole = [m for m, has in (("embed_tokens", saved.embed is not None),
                              *((n, n in norms) for n in LAYER_NORMS),
                              ("norm", saved.final_norm is not None),
                              ("lm_head", saved.head is not None)) if has]
    return [f"{feature}:{','.join(modules)}" for feature, modules in ((TRAINABLE_TOKENS, rows),
                                                                      (MODULES_TO_SAVE, whole)) if modules]

