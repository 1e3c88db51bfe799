"""How large an adapter for a given base model can be: the bound every upload is held to.

A LoRA adapter holds, per layer and projection, A [rank, in], B [out, rank] and at most one
vector [out] (DoRA's magnitude or lora_B's bias: PEFT refuses both at once). So for a
base model and a rank cap its safetensors file has a hard upper size; a file (or a zip
member inflating to one) past that size cannot be a valid adapter and is refused before
it is read or written whole.
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
    """Every projection of every layer: A, B and a magnitude or bias vector."""
    return 3 * len(LORA_MODULES) * base.num_layers


def max_header_bytes(base: BaseShapes) -> int:
    """The largest safetensors JSON header an adapter for `base` needs."""
    return _HEADER_BASE_BYTES + _HEADER_BYTES_PER_TENSOR * max_tensor_count(base)


def max_adapter_bytes(base: BaseShapes, max_rank: int, dtype: torch.dtype = torch.float32) -> int:
    """Upper size of `adapter_model.safetensors` for `base` at rank `max_rank` in `dtype`.

    Every projection of every layer at the full rank with a vector, plus the largest header. Pass the
    widest dtype uploads may use (float32 by default: PEFT saves float32 unless told to
    save in the training dtype, which is narrower).
    """
    if max_rank < 1:
        raise ValueError(f"max_rank must be at least 1, not {max_rank}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_layer = sum(max_rank * sum(base.module_dims(m)) + base.module_dims(m)[1] for m in LORA_MODULES)
    return 8 + max_header_bytes(base) + per_layer * base.num_layers * itemsize
