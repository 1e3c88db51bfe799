"""The weights of an adapter mixture, as PEFT's `add_weighted_adapter(combination_type="cat")`
builds them: per module, A is the row-concatenation of each component's A * weight *
scaling, B the column-concatenation of their B, and the scaling is 1. Its delta is thus
sum_i weight_i * scaling_i * B_i A_i x, at the summed rank: low rank, never a dense merge.

A module some components do not target gets only the others' blocks (PEFT pads it with
zero rows, which add nothing). Where PEFT's result depends on the first component's config
rather than on the weights (it copies use_rslora and layers_to_transform from it), the
mixture here is the weighted sum itself. Only plain LoRA mixes: DoRA's rescale, lora_B
biases and saved modules have no weighted sum PEFT defines, so such components are refused.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import AdapterValidationError
from .peft import LoRAAdapter, LoRAWeight
from .shapes import LORA_MODULES


def mix_adapters(digest: str, parts: Sequence[tuple[str, LoRAAdapter, float]], max_rank: int) -> LoRAAdapter:
    """The mixture of `parts` (name, adapter, weight), in that order, as one adapter with
    identity `digest`; AdapterValidationError for a component that cannot mix, or a summed
    rank above `max_rank`."""
    for name, adapter, _ in parts:
        _check_plain(name, adapter)
    keys = sorted({key for _, adapter, _ in parts for key in adapter.weights})
    weights: dict[tuple[int, str], LoRAWeight] = {}
    for key in keys:
        pieces = [(a.weights[key], w) for _, a, w in parts if key in a.weights]
        # PEFT's order of operations: (A * weight) * scaling, in the weights' dtype.
        a = torch.cat([p.a * w * p.scale for p, w in pieces]).contiguous()
        b = torch.cat([p.b for p, _ in pieces], dim=1).contiguous()
        weights[key] = LoRAWeight(a=a, b=b, scale=1.0)
    rank = max(w.rank for w in weights.values())
    if rank > max_rank:
        raise AdapterValidationError(f"the mixture's summed rank {rank} is above this engine's max_lora_rank "
                                     f"{max_rank}: mix fewer or smaller adapters")
    present = {m for _, m in weights}
    return LoRAAdapter(
        digest=digest, rank=rank, target_modules=tuple(m for m in LORA_MODULES if m in present),
        alpha=float(rank), use_rslora=False,
        size_bytes=sum(t.nbytes for w in weights.values() for t in w.tensors()), weights=weights)


def _check_plain(name: str, adapter: LoRAAdapter) -> None:
    for what, has in (("DoRA", any(w.magnitude is not None for w in adapter.weights.values())),
                      ("lora_B biases (lora_bias)", any(w.bias is not None for w in adapter.weights.values())),
                      ("saved modules (modules_to_save, trainable tokens)", adapter.saved is not None)):
        if has:
            raise AdapterValidationError(f"adapter {name!r} uses {what}: only plain LoRA adapters can be mixed")
