"""bf16 linear layers in C on AMX tiles (amx.c) for Xeons that have them.

`AmxLinear` holds the weight packed once as dpbf16.c packs it (AMX's B tiles are that
layout), and serves each call from the kernel that streams its row count fastest: AMX
from `FROM_ROWS` rows, dpbf16.c's vdpbf16ps below (a decode of a few rows streams the
weights as fast there) and for a K that is not a multiple of 32, which AMX tiles cannot
take. Its reference is `F.linear` on the same bf16 tensors, which the tests compare it
with.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from . import build, dpbf16

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_ARGTYPES = [_P, _L, _P, _P, _P, _L, _I, _I, _I, _I, _I]
M_CHUNK = 256  # rows per work item (amx.c M_CHUNK)
K_STEP = 32  # values of k per tile
# Against vdpbf16ps on SmolLM2's four projection shapes (bench_kernels_cpu.py, 2 threads of
# an AMX Xeon): 1-2 rows 0.81-1.02x, 4 rows 0.86-1.20x, 8 rows 1.11-1.49x, 12 rows 1.55-1.89x.
FROM_ROWS = 8


def load_library() -> ctypes.CDLL | None:
    return build.load("amx.c", {"gemm_amx": _ARGTYPES, "amx_available": []})


@functools.cache
def supported() -> bool:
    """The kernel builds here, this CPU has AMX and Linux lets this process use it, and
    dpbf16.c (the rows below FROM_ROWS) runs here too."""
    lib = load_library()
    return lib is not None and lib.amx_available() == 1 and dpbf16.native()


def amx_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W[n, K]^T (+ bias) in bf16 with fp32 accumulation and one rounding on
    AMX tiles; `packed` is dpbf16.pack_weight(W) and K a multiple of 32."""
    lib = load_library()
    assert lib is not None and supported(), "no AMX kernel here: use dpbf16_linear"
    assert x.dtype == packed.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1, (x.dtype, x.shape)
    M, K = x.shape
    assert K % K_STEP == 0, K
    assert packed.shape == (-(-n // dpbf16.PANEL), K // 2, dpbf16.PANEL, 2) and packed.is_contiguous(), (packed.shape, n)
    assert bias is None or (bias.dtype == torch.bfloat16 and bias.shape == (n,) and bias.is_contiguous())
    y = torch.empty(M, n, dtype=torch.bfloat16)
    if M == 0:
        return y
    items = -(-packed.shape[0] // 2) * -(-M // M_CHUNK)
    args = (x.data_ptr(), x.stride(0), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
            y.data_ptr(), y.stride(0), M, n, K)
    build.run(lib.gemm_amx, args, items)
    return y


def tiled_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`amx_linear` from FROM_ROWS rows where K allows it, `dpbf16_linear` otherwise."""
    if x.shape[0] >= FROM_ROWS and x.shape[1] % K_STEP == 0:
        return amx_linear(x, packed, n, bias)
    return dpbf16.dpbf16_linear(x, packed, n, bias)


class AmxLinear(dpbf16.Dpbf16Linear):
    """`y = x W^T + b` in bf16 on AMX tiles, few rows with vdpbf16ps (inference only);
    one packed copy of W."""

    linear = staticmethod(tiled_linear)
