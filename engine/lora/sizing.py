"""Device bytes of an adapter: what its pages of the KV pool must hold."""
from __future__ import annotations

import torch

from .packing import GROUPS


def entry_device_bytes(entry: tuple, dtype: torch.dtype) -> int:
    """Bytes of a CPU-tier entry (adapter, epilogues) on the device: A and B over every
    layer and module in `dtype`, its fp32 epilogues (DoRA, lora_bias) and its saved
    modules (saved_modules.py) in `dtype`."""
    adapter, epilogues = entry
    epilogue = sum(t.numel() for parts in epilogues.values() for t in parts if t is not None) * 4
    lora = sum(w.a.numel() + w.b.numel() for w in adapter.weights.values()) * dtype.itemsize
    saved = getattr(adapter, "saved", None)
    # Token ids are int64 on the device whatever `dtype` is.
    extra = 0 if saved is None else sum(t.numel() * (8 if t.dtype == torch.int64 else dtype.itemsize)
                                        for t in saved.tensors())
    return lora + epilogue + extra


def max_lora_device_bytes(in_sizes: dict[str, int], out_sizes: dict[str, int], num_layers: int, max_rank: int,
                          dtype: torch.dtype) -> int:
    """The most an adapter's LoRA weights and epilogues take at rank `max_rank` (saved
    modules aside: an adapter is sized from its own tensors once it is in the CPU tier)."""
    per_layer = sum(max_rank * (in_sizes[g] + sum(out_sizes[m] for m in mods)) for g, mods in GROUPS.items())
    epilogue = 8 * sum(out_sizes.values())  # fp32 scale and shift (DoRA, lora_bias)
    return (per_layer * dtype.itemsize + epilogue) * num_layers
