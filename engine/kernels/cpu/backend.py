"""The "cpu" backend: C kernels (built at first use) for attention, the KV write, the
fused layer steps, multi-LoRA and the bf16 linears for the row counts where oneDNN has no
faster path (linear_choice.py)."""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from ..torch.backend import TorchBackend
from ..torch.linear import PackedLinear, WideLinear, packing_supported, widening_supported
from . import amx, dpbf16, gemm, linear_choice
from .decode import cpu_paged_attention
from .fused import CLayerOps, cpu_write_kv
from .lora_backend import CLoRABackend
from .metadata import CpuAttentionMetadata, build_cpu_metadata
from .draw import plain_draw
from .nucleus import nucleus_threshold

log = logging.getLogger(__name__)


class CpuBackend(TorchBackend):
    name = "cpu"
    lora_backend = CLoRABackend
    write_kv = staticmethod(cpu_write_kv)
    paged_attention = staticmethod(cpu_paged_attention)
    nucleus = staticmethod(nucleus_threshold)
    plain_draw = staticmethod(plain_draw)

    def build_metadata(self, seqs: list[tuple[int, int, list[int]]], block_size: int) -> CpuAttentionMetadata:
        return build_cpu_metadata(seqs, block_size, self.dtype, self.device)

    def layer_ops(self) -> CLayerOps:
        return CLayerOps(self.dtype)

    def linear_factory(self, weight_bytes: int = 0, spare_bytes: int | None = None
                       ) -> Callable[[torch.Tensor, torch.Tensor | None], nn.Module] | None:
        if self.dtype != torch.bfloat16:
            return super().linear_factory(weight_bytes, spare_bytes)
        # The C kernel streams a small decode step's rows fastest; oneDNN, on the packed
        # bf16 weight or on the weight widened to fp32 (where bf16 is emulated), may
        # serve more rows faster (measured).
        few = c_linear()
        if few is None:
            return super().linear_factory(weight_bytes, spare_bytes)
        many = [make for make, ok in ((PackedLinear, packing_supported(self.device, self.dtype)),
                                      (WideLinear, widening_supported(self.device, self.dtype))) if ok]
        many = [make for make in many if _fits(linear_choice.split_extra_bytes(few, make, weight_bytes), spare_bytes,
                                              make)]
        return linear_choice.choose(few, many).make() if many else few


def c_linear() -> Callable[[torch.Tensor, torch.Tensor | None], nn.Module] | None:
    """The C bf16 linear for this CPU: AMX tiles (amx.py) where it has them, else
    dpbf16.py with AVX-512 (vdpbf16ps, or two FMAs on widened halves without
    AVX512-BF16), else the 8-lane widening GEMM (gemm.py); None where no kernel builds
    (no C compiler)."""
    if amx.supported():
        return amx.AmxLinear
    if dpbf16.supported():
        return dpbf16.Dpbf16Linear
    return gemm.Bf16Linear if gemm.load_library() else None


def _fits(extra: int, spare: int | None, make) -> bool:
    """Whether a second copy of the weights for `make` (`extra` bytes) fits in `spare`."""
    if spare is None or extra <= spare:
        return True
    log.warning("bf16 linears: %s would hold %.2f GiB beyond the weights, more than the host's %.2f GiB to "
                "spare; not used", getattr(make, "__name__", make), extra / 2**30, spare / 2**30)
    return False
