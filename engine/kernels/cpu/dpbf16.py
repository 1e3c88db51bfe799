"""bf16 linear layers in C (dpbf16.c) for CPUs with AVX-512: vdpbf16ps where the CPU has
AVX512-BF16, two FMAs on the widened halves of each k pair where it has AVX-512F alone.

`Dpbf16Linear` replaces `nn.Linear` there on the "cpu" backend (engine/models/llama.py
`pack_weights`); its reference is `F.linear` on the same bf16 tensors, which the tests
compare it with. On 2 cores of an AVX512-BF16 EPYC it measured 1.1-2.3x oneDNN's packed
bf16 matmul from 1 to 32 rows (decode steps, which it streams at up to ~30 GB/s) and
the same ~400 GFLOP/s from 128 to 1024 rows (benchmarks/bench_kernels_cpu.py).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from . import build
from .gemm import Bf16Linear

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_ARGTYPES = [_P, _L, _P, _P, _P, _L, _I, _I, _I, _I, _I]
PANEL = 16  # output columns per packed panel (dpbf16.c)
GROUP = 3  # panels per work item (dpbf16.c NR)
M_CHUNK = 256  # rows per work item (dpbf16.c M_CHUNK)


def load_library() -> ctypes.CDLL | None:
    return build.load("dpbf16.c", {"gemm_dpbf16": _ARGTYPES, "dpbf16_available": []})


@functools.cache
def path() -> int:
    """1: vdpbf16ps (AVX512-BF16); 2: its AVX-512F spelling; 0: neither (compiled empty)
    or no C compiler."""
    lib = load_library()
    return 0 if lib is None else lib.dpbf16_available()


def supported() -> bool:
    """The kernel builds here and this CPU has AVX-512 (one path or the other)."""
    return path() != 0


def native() -> bool:
    """This CPU has vdpbf16ps itself (what amx.c's rows below its tiles need)."""
    return path() == 1


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [ceil(N/16), ceil(K/2), 16, 2] (zero-padded), vdpbf16ps's operand layout."""
    N, K = w.shape
    padded = torch.zeros(-(-N // PANEL) * PANEL, -(-K // 2) * 2, dtype=w.dtype)
    padded[:N, :K] = w
    return padded.view(-1, PANEL, padded.shape[1] // 2, 2).transpose(1, 2).contiguous()


def dpbf16_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W[n, K]^T (+ bias) in bf16 with fp32 accumulation and one rounding;
    `packed` is pack_weight(W)."""
    lib = load_library()
    assert lib is not None and supported(), "no AVX-512 kernel here: use F.linear"
    assert x.dtype == packed.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1, (x.dtype, x.shape)
    M, K = x.shape
    assert packed.shape == (-(-n // PANEL), -(-K // 2), PANEL, 2) and packed.is_contiguous(), (packed.shape, n, K)
    assert bias is None or (bias.dtype == torch.bfloat16 and bias.shape == (n,) and bias.is_contiguous())
    y = torch.empty(M, n, dtype=torch.bfloat16)
    if M == 0:
        return y
    items = -(-packed.shape[0] // GROUP) * -(-M // M_CHUNK)
    args = (x.data_ptr(), x.stride(0), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
            y.data_ptr(), y.stride(0), M, n, K)
    build.run(lib.gemm_dpbf16, args, items)
    return y


class Dpbf16Linear(Bf16Linear):
    """`y = x W^T + b` in bf16 with vdpbf16ps (inference only); one packed copy of W."""

    pack = staticmethod(pack_weight)
    linear = staticmethod(dpbf16_linear)
