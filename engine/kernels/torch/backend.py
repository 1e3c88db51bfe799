"""The torch backend: kernels/torch/attention.py's paged attention and KV write, the torch
layer ops and LoRA, oneDNN-packed linears where the CPU runs bf16/fp16 natively.
The reference of the other backends, and what they keep of it where they fuse nothing
(the "triton" backend's layer ops and linears; the "cpu" backend's packed linears)."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ...lora.torch_backend import TorchLoRABackend
from ..backend import KernelBackend
from . import attention
from .layer_ops import TorchLayerOps
from .linear import PackedLinear, packing_supported


class TorchBackend(KernelBackend):
    name = "torch"
    lora_backend = TorchLoRABackend
    write_kv = staticmethod(attention.write_kv)
    paged_attention = staticmethod(attention.paged_attention)

    def build_metadata(self, seqs: list[tuple[int, int, list[int]]], block_size: int
                       ) -> attention.TorchAttentionMetadata:
        return attention.build_metadata(seqs, block_size, self.dtype, self.device)

    def layer_ops(self) -> type[TorchLayerOps]:
        return TorchLayerOps

    def linear_factory(self, weight_bytes: int = 0, spare_bytes: int | None = None
                       ) -> Callable[[torch.Tensor, torch.Tensor | None], nn.Module] | None:
        return PackedLinear if packing_supported(self.device, self.dtype) else None
