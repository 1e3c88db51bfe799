"""How large an adapter for a given base model can be: the bound every upload is held to.

A LoRA adapter holds, per layer and projection, A [rank, in], B [out, rank] and at most one
vector [out] (DoRA's magnitude or lora_B's bias: PEFT refuses both at once); beside LoRA
it may save (modules_to_save, trainable_token_indices) at most one embedding-sized matrix
[vocab, hidden] for the embedding and one for the lm_head (a module is saved whole or by
rows, never both) and every RMSNorm weight [hidden]. So for a base model and a rank cap
its safetensors file has a hard upper size; a file (or a zip member inflating to one)
past that size cannot be a valid adapter and is refused before it is read or written
whole. For a large vocabulary the two matrices dominate the bound (SmolLM2: 2 x 49152 x
576 fp32, 226 MB): an upload that saves them must fit it, and does.
"""
from __future__ import annotations

import torch

from .shapes import LORA_MODULES, BaseShapes

# The per-tensor JSON a safetensors header holds: a PEFT name (~70 bytes), dtype, shape and
# offsets. 1 KiB each leaves room for long names and writer metadata.
_HEADER_BYTES_PER_TENSOR = 1024
_HEADER_BASE_BYTES = 64 * 1024
MAX_CONFIG_BYTES = 1 << 20


def max_tensor_count(base: BaseShapes) -> int:
    """Every projection of every layer: A, B and a magnitude or bias vector; the embedding
    and lm_head (whole or by rows) and every norm."""
    return 3 * len(LORA_MODULES) * base.num_layers + 2 + 2 * base.num_layers + 1


def max_header_bytes(base: BaseShapes) -> int:
    """The largest safetensors JSON header an adapter for `base` needs."""
    return _HEADER_BASE_BYTES + _HEADER_BYTES_PER_TENSOR * max_tensor_count(base)


def max_adapter_bytes(base: BaseShapes, max_rank: int, dtype: torch.dtype = torch.float32) -> int:
    """Upper size of `adapter_model.safetensors` for `base` at rank `max_rank` in `dtype`.

    Every projection of every layer at the full rank with a vector, a saved embedding and
    lm_head and every norm, plus the largest header. Pass the
    widest dtype uploads may use (float32 by default: PEFT saves float32 unless told to
    save in the training dtype, which is narrower).
    """
    if max_rank < 1:
        raise ValueError(f"max_rank must be at least 1, not {max_rank}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_layer = sum(max_rank * sum(base.module_dims(m)) + base.module_dims(m)[1] for m in LORA_MODULES)
    saved = 2 * base.vocab_size * base.hidden_size + (2 * base.num_layers + 1) * base.hidden_size
    return 8 + max_header_bytes(base) + (per_layer * base.num_layers + saved) * itemsize
