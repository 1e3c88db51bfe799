"""One kernel backend per device, registered by name and chosen once at start."""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from ..attention import AttentionMetadata
from ..cpu_linear import PackedLinear, packing_supported
from ..lora.backend import LoRABackend
from ..models.llama import TorchLayerOps

# name -> "module:class", imported only when chosen: "triton" must not import Triton
# on a machine that never runs it.
REGISTRY: dict[str, str] = {
    "torch": ".torch_backend:TorchBackend",
    "cpu": ".cpu.backend:CpuBackend",
    "triton": ".triton.backend:TritonBackend",
}


class KernelBackend(ABC):
    """Everything the model runner asks of the kernels of one device.

    Contract:
    - `build_metadata(seqs, block_size)`: (start_pos, num_new_tokens, block_ids) per
      sequence in batch order, decodes first -> this backend's own `AttentionMetadata`
      subclass, holding only what its attention reads; called once per step.
    - `write_kv(k_cache, v_cache, k, v, slot_mapping)` and `paged_attention(q, k_cache,
      v_cache, meta, scale)`: engine/attention.py's `write_kv` and `paged_attention`
      contracts over this backend's metadata. Plain functions (class attributes), so a
      layer calls them with no bound-method hop.
    - `layer_ops()`: an object with `TorchLayerOps`' methods and results.
    - `linear_factory()`: make(weight, bias) -> module computing `F.linear`, to replace
      every projection and the LM head with, or None to keep `nn.Linear`.
    - `lora_backend`: the `LoRABackend` class the LoRA manager binds to.
    Results equal the torch backend's within the dtype's rounding.
    """

    name: ClassVar[str]
    lora_backend: ClassVar[type[LoRABackend]]
    write_kv: ClassVar[Callable[..., None]]
    paged_attention: ClassVar[Callable[..., torch.Tensor]]

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype

    @abstractmethod
    def build_metadata(self, seqs: list[tuple[int, int, list[int]]], block_size: int) -> AttentionMetadata: ...

    def layer_ops(self):
        return TorchLayerOps

    def linear_factory(self) -> Callable[[torch.Tensor, torch.Tensor | None], nn.Module] | None:
        return PackedLinear if packing_supported(self.device, self.dtype) else None


def create_backend(name: str, device: torch.device, dtype: torch.dtype) -> KernelBackend:
    """The backend registered as `name` (select.select_backend's answer) for this device."""
    if name not in REGISTRY:
        raise ValueError(f"unknown kernel backend {name!r}; registered: {sorted(REGISTRY)}")
    module, cls = REGISTRY[name].split(":")
    backend = getattr(importlib.import_module(module, __package__), cls)(device, dtype)
    assert backend.name == name, (backend.name, name)
    return backend
