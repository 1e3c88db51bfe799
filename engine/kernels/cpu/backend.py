"""The "cpu" backend: C kernels (built at first use) for attention, the KV write, the
fused layer steps, multi-LoRA and the bf16 linears for the row counts where oneDNN has no
faster path (linear_choice.py)."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..torch.backend import TorchBackend
from ..torch.linear import packing_supported
from . import dpbf16, gemm, linear_choice
from .decode import cpu_paged_attention
from .fused import CLayerOps, cpu_write_kv
from .lora_backend import CLoRABackend
from .metadata import CpuAttentionMetadata, build_cpu_metadata


class CpuBackend(TorchBackend):
    name = "cpu"
    lora_backend = CLoRABackend
    write_kv = staticmethod(cpu_write_kv)
    paged_attention = staticmethod(cpu_paged_attention)

    def build_metadata(self, seqs: list[tuple[int, int, list[int]]], block_size: int) -> CpuAttentionMetadata:
        return build_cpu_metadata(seqs, block_size, self.dtype, self.device)

    def layer_ops(self) -> CLayerOps:
        return CLayerOps(self.dtype)

    def linear_factory(self) -> Callable[[torch.Tensor, torch.Tensor | None], nn.Module] | None:
        c_bf16 = self.dtype == torch.bfloat16
        if c_bf16 and dpbf16.supported():
            # AVX512-BF16: the C kernel streams small decode steps fastest; where oneDNN
            # has faster instructions for more rows (AMX), it serves those (measured).
            if packing_supported(self.device, self.dtype):
                return linear_choice.linear_for_this_cpu()
            return dpbf16.Dpbf16Linear
        if packing_supported(self.device, self.dtype):
            return super().linear_factory()
        if c_bf16 and gemm.load_library() is not None:
            # oneDNN has no fast bf16 path on this CPU (AVX2 only): the C GEMM instead.
            return gemm.Bf16Linear
        return None
