"""Linear layers with weights pre-packed for oneDNN (bf16/fp16 on CPU, or widened to fp32).

`F.linear` on a bf16 CPU tensor hands the weight to oneDNN, which re-lays it out into
its blocked (AMX/AVX-512) format on every call. For a small decode batch that copy is
most of the work: the step reads every weight twice. Packing once at load time
measured 1.6x faster at 1 and 16 rows and 1.25x at 64 rows on SmolLM2 shapes, with
bit-identical results.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

# The row count oneDNN tunes the packed layout for; it serves every row count (measured
# from 1 to 1024 rows), decode widths being the ones that matter most.
_BATCH_HINT = 256


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and _cpu_can_pack(dtype)


@functools.cache
def _cpu_can_pack(dtype: torch.dtype) -> bool:
    """oneDNN packs bf16/fp16 only on CPUs with the instructions for it (AVX-512 or
    AVX-NE-CONVERT; an AVX2-only EPYC has neither): ask it once with a tiny weight."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), _BATCH_HINT)
    except RuntimeError as exc:
        log.info("oneDNN cannot pre-pack %s weights on this CPU (%s); using F.linear", dtype, exc)
        return False
    return True


def builds_state_per_shape(module: nn.Module) -> bool:
    """Whether `module`'s first call at a row count builds state that later calls at that
    row count reuse (oneDNN's primitive for the shape; cuBLAS's choices on a GPU), a cost
    `ModelRunner.warm_up` moves before serving. A kernel class says so in
    `per_shape_state`; for a plain layer (an `nn.Linear`, or `F.linear` on an embedding's
    weight) it holds on a GPU and for bf16/fp16 on a CPU (torch hands those to oneDNN),
    not for fp32 on a CPU (BLAS sgemm: a first call measured as fast as the next)."""
    declared = getattr(module, "per_shape_state", None)
    if declared is not None:
        return bool(declared)
    weight = module.weight
    return weight.device.type != "cpu" or weight.dtype != torch.float32


class PackedLinear(nn.Module):
    """`y = x W^T + b` with W held in oneDNN's blocked layout (inference only)."""

    weight_bytes_held = 1  # bytes held per byte of the weight it was made from
    per_shape_state = True  # oneDNN's primitive per row count

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features).contiguous(), self.packed,
                                               self.bias, "none", [], "")
        return y.view(*lead, self.out_features)


def widening_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """`WideLinear` can serve `dtype` here: a bf16/fp16 model on a CPU whose oneDNN packs
    fp32 weights (any x86 CPU it runs on)."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and _cpu_can_pack(torch.float32)


class WideLinear(nn.Module):
    """`y = x W^T + b` for bf16/fp16 `x` and W, computed in fp32: W widened once and packed
    for oneDNN's fp32 matmul (inference only; twice W's bytes).

    For CPUs that run bf16 matmuls by emulation: on a Xeon with AVX-512 but neither
    AVX512-BF16 nor AMX, oneDNN's bf16 matmul ran at ~60 GFLOP/s on 2 threads at every
    row count, its fp32 matmul at 130-200 from 32 rows up. The numbers are bf16's: a
    product of two bf16 values is exact in fp32, the sums accumulate in fp32 as the
    bf16 matmul's do, and the result is rounded once; only the order of the sums differs.
    """

    weight_bytes_held = 2  # bytes held per byte of the weight it was made from
    per_shape_state = True  # oneDNN's primitive per row count

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), _BATCH_HINT)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features).float(), self.packed,
                                               self.bias, "none", [], "")
        return y.to(x.dtype).view(*lead, self.out_features)


def pack_linears(module: nn.Module, make=PackedLinear) -> int:
    """Replace every nn.Linear under `module` by make(weight, bias) (PackedLinear, or
    kernels.cpu.gemm.Bf16Linear); returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child.weight, child.bias))
            count += 1
        else:
            count += pack_linears(child, make)
    return count
