"""Fused elementwise layer steps in C (fused.c): RMSNorm with the residual add,
rotary embedding in place, SiLU-and-multiply.

`CLayerOps` has the methods of `engine.kernels.torch.layer_ops.TorchLayerOps`, its reference, and
the model uses it when the runner picks the "cpu" kernels.
"""
from __future__ import annotations

import ctypes

import torch

from . import build

_P, _I, _F, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
_SIGNATURES = {
    **{f"add_rms_norm_{t}": [_P, _P, _P, _P, _I, _F, _I, _I] for t in ("bf16", "f32")},
    **{f"rope_{t}": [_P, _L, _P, _P, _I, _I, _I, _I] for t in ("bf16", "f32")},
    **{f"silu_mul_{t}": [_P, _P, _I, _I, _I] for t in ("bf16", "f32")},
    **{f"write_kv_{t}": [_P, _P, _P, _P, _L, _P, _I, _I, _L, _I, _I] for t in ("u16", "u32")},
}
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def load_library() -> ctypes.CDLL | None:
    return build.load("fused.c", _SIGNATURES)


def cpu_write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """engine.attention.write_kv's contract; k/v may be row-strided views of the qkv output."""
    lib = load_library()
    assert lib is not None, "load_library() returned None: use the torch write_kv"
    T, KVH, Dh = k.shape
    assert k_cache.shape == v_cache.shape and k_cache.shape[0] == KVH and k_cache.shape[2] == Dh
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k.shape == v.shape
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and k.dtype.itemsize in (2, 4)
    assert k.stride(2) == 1 and k.stride(1) == Dh and v.stride() == k.stride(), "rows of contiguous heads"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (T,) and slot_mapping.is_contiguous()
    fn = lib.write_kv_u16 if k.dtype.itemsize == 2 else lib.write_kv_u32
    build.run(fn, (k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0),
                             slot_mapping.data_ptr(), KVH, Dh, k_cache.shape[1]), T)


class CLayerOps:
    """The C versions of a layer's elementwise steps (bf16 and fp32 on CPU)."""

    def __init__(self, dtype: torch.dtype) -> None:
        lib = load_library()
        assert lib is not None, "load_library() returned None: use TorchLayerOps"
        assert dtype in _SUFFIX, dtype
        sfx = _SUFFIX[dtype]
        self.dtype = dtype
        self._norm = getattr(lib, f"add_rms_norm_{sfx}")
        self._rope = getattr(lib, f"rope_{sfx}")
        self._silu_mul = getattr(lib, f"silu_mul_{sfx}")

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, rms_norm(x + delta)); the sum is written into x in place."""
        T, hidden = x.shape
        assert x.dtype == weight.dtype == self.dtype and x.is_contiguous() and weight.shape == (hidden,)
        assert delta is None or (delta.shape == x.shape and delta.dtype == x.dtype and delta.is_contiguous())
        out = torch.empty_like(x)
        build.run(self._norm, (x.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(),
                                         out.data_ptr(), hidden, eps), T)
        return x, out

    def rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the q and k heads of the fused qkv rows in place; returns (q, k) views."""
        T, width = qkv.shape
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        assert qkv.dtype == cos.dtype == sin.dtype == self.dtype and qkv.stride(1) == 1 and width >= q_size + kv_size
        assert cos.is_contiguous() and sin.is_contiguous() and cos.numel() == sin.numel() == T * head_dim
        assert head_dim % 2 == 0
        build.run(self._rope, (qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(),
                                         num_heads + num_kv_heads, head_dim), T)
        return (qkv[:, :q_size].view(T, num_heads, head_dim),
                qkv[:, q_size:q_size + kv_size].view(T, num_kv_heads, head_dim))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        T, width = gate_up.shape
        assert gate_up.dtype == self.dtype and gate_up.is_contiguous() and width % 2 == 0
        out = torch.empty(T, width // 2, dtype=gate_up.dtype)
        build.run(self._silu_mul, (gate_up.data_ptr(), out.data_ptr(), width // 2), T)
        return out
