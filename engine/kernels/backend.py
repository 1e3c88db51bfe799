"""One kernel backend per device, registered by name and chosen once at start."""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..lora.backend import LoRABackend

# name -> "module:class", imported only when chosen: "triton" must not import Triton
# on a machine that never runs it.
REGISTRY: dict[str, str] = {
    "torch": ".torch.backend:TorchBackend",
    "cpu": ".cpu.backend:CpuBackend",
    "triton": ".triton.backend:TritonBackend",
}


@dataclass
class AttentionMetadata:
    """What every backend's attention reads: where each new token's K/V goes, and how
    many of the batch's first sequences are decodes. Each kernel backend builds its own
    subclass (`KernelBackend.build_metadata`), holding only the form its kernels take."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    block_size: int = 16
    num_decodes: int = 0


class KernelBackend(ABC):
    """Everything the model runner asks of the kernels of one device.

    Contract:
    - `build_metadata(seqs, block_size)`: (start_pos, num_new_tokens, block_ids) per
      sequence in batch order, decodes first -> this backend's own `AttentionMetadata`
      subclass, holding only what its attention reads; called once per step.
    - `write_kv(k_cache, v_cache, k, v, slot_mapping)` and `paged_attention(q, k_cache,
      v_cache, meta, scale)`: engine/kernels/torch/attention.py's `write_kv` and `paged_attention`
      contracts over this backend's metadata. Plain functions (class attributes), so a
      layer calls them with no bound-method hop.
    - `layer_ops()`: an object with the methods and results of
      kernels/torch/layer_ops.py's `TorchLayerOps`.
    - `linear_factory(weight_bytes, spare_bytes)`: make(weight, bias) -> module computing
      `F.linear`, to replace every projection and the LM head with, or None to keep
      `nn.Linear`. The layers it makes hold at most `spare_bytes` (None: no bound) beyond
      the `weight_bytes` of the weights they are made from.
    - `lora_backend`: the `LoRABackend` class the LoRA manager binds to.
    - `nucleus`: None (the sampler sorts), or the sampler's min-p / top-k / top-p
      thresholds without a sort for logits on this device (engine/sampler.py `Nucleus`;
      kernels/cpu/nucleus.py `nucleus_threshold` is the contract).
    - `plain_draw`: None (the sampler widens the logits and draws by torch), or the
      sampler's draw for greedy and temperature-only rows from the raw logits on this
      device (engine/sampler.py `PlainDraw`; kernels/cpu/draw.py `plain_draw`).
    Results equal the torch backend's within the dtype's rounding.
    """

    name: ClassVar[str]
    lora_backend: ClassVar[type[LoRABackend]]
    write_kv: ClassVar[Callable[..., None]]
    paged_attention: ClassVar[Callable[..., torch.Tensor]]
    nucleus: ClassVar[Callable[..., torch.Tensor] | None] = None
    plain_draw: ClassVar[Callable[..., torch.Tensor] | None] = None

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype

    @abstractmethod
    def build_metadata(self, seqs: list[tuple[int, int, list[int]]], block_size: int) -> AttentionMetadata: ...

    @abstractmethod
    def layer_ops(self): ...

    @abstractmethod
    def linear_factory(self, weight_bytes: int = 0, spare_bytes: int | None = None
                       ) -> Callable[[torch.Tensor, torch.Tensor | None], nn.Module] | None: ...


def create_backend(name: str, device: torch.device, dtype: torch.dtype) -> KernelBackend:
    """The backend registered as `name` (select.select_backend's answer) for this device."""
    if name not in REGISTRY:
        raise ValueError(f"unknown kernel backend {name!r}; registered: {sorted(REGISTRY)}")
    module, cls = REGISTRY[name].split(":")
    backend = getattr(importlib.import_module(module, __package__), cls)(device, dtype)
    assert backend.name == name, (backend.name, name)
    return backend
