"""bf16 linear layers in C (gemm.c) for CPUs where oneDNN cannot run bf16 matmuls fast.

`Bf16Linear` replaces `nn.Linear` there (engine/models/llama.py `pack_weights`); its
reference is `F.linear` on the same bf16 tensors, which the tests compare it with.
"""
from __future__ import annotations

import ctypes

import torch
from torch import nn

from . import build

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_ARGTYPES = [_P, _L, _P, _P, _P, _L, _I, _I, _I]
PANEL = 16  # output columns per packed panel and work item (gemm.c PANEL)


def load_library() -> ctypes.CDLL | None:
    return build.load("gemm.c", {"gemm_bf16": _ARGTYPES})


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> panels [ceil(N / PANEL), K, PANEL] (zero-padded columns), the layout
    gemm.c reads: one k step of a panel is one contiguous run."""
    N, K = w.shape
    padded = torch.zeros(-(-N // PANEL) * PANEL, K, dtype=w.dtype)
    padded[:N] = w
    return padded.view(-1, PANEL, K).transpose(1, 2).contiguous()


def cpu_gemm_bf16(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W[n, K]^T (+ bias) in bf16 with fp32 accumulation and one rounding;
    `packed` is pack_weight(W)."""
    lib = load_library()
    assert lib is not None, "load_library() returned None: use F.linear"
    assert x.dtype == packed.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1, (x.dtype, x.shape)
    M, K = x.shape
    assert packed.shape == (-(-n // PANEL), K, PANEL) and packed.is_contiguous(), (packed.shape, n, K)
    assert bias is None or (bias.dtype == torch.bfloat16 and bias.shape == (n,) and bias.is_contiguous())
    y = torch.empty(M, n, dtype=torch.bfloat16)
    if M == 0:
        return y
    args = (x.data_ptr(), x.stride(0), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
            y.data_ptr(), y.stride(0), M, n, K)
    build.run(lib.gemm_bf16, args, packed.shape[0])
    return y


class Bf16Linear(nn.Module):
    """`y = x W^T + b` in bf16 on a CPU without oneDNN bf16 support (inference only).

    On an AVX2 EPYC with 2 threads the C kernel measured 4-8x torch's bf16 matmul (which
    runs ~15 GFLOP/s there) from 16 to 256 rows, and 1-3x fp32 oneDNN on the widened
    weight (benchmarks/bench_kernels_cpu.py). It reads the packed weight once per call.
    """

    # The weight layout and the kernel (kernels/cpu/dpbf16.py `Dpbf16Linear` swaps both).
    pack = staticmethod(pack_weight)
    linear = staticmethod(cpu_gemm_bf16)
    weight_bytes_held = 1  # bytes held per byte of the weight it was made from
    per_shape_state = False  # the same C loop for every row count

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        assert weight.dtype == torch.bfloat16 and weight.device.type == "cpu", (weight.dtype, weight.device)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = self.pack(weight.detach())
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        y = self.linear(x2 if x2.stride(1) == 1 else x2.contiguous(), self.packed, self.out_features, self.bias)
        return y.view(*lead, self.out_features)
