"""The C decode-attention kernel (decode.c), built and called through build.py.

Without a C compiler the engine keeps the torch path (engine/kernels/torch/attention.py), which is
also this kernel's reference in the tests.
"""
from __future__ import annotations

import ctypes

import torch

from ..torch.attention import prefill_attention
from . import build, prefill, prefill_amx
from .metadata import CpuAttentionMetadata

_ARGTYPES = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 5
             + [ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int])


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (reason logged once) where it cannot be built."""
    return build.load("decode.c", {"paged_decode_bf16": _ARGTYPES, "paged_decode_f32": _ARGTYPES})


def cpu_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, scale: float) -> None:
    """out[s] = attention of decode query q[s] ([D, heads, head_dim]) over its first
    seq_lens[s] cached positions, found through block_tables[s]."""
    lib = load_library()
    assert lib is not None, "load_library() returned None: use the torch path"
    D, H, Dh = q.shape
    KVH, slots = k_cache.shape[0], k_cache.shape[1]
    assert q.dtype == k_cache.dtype == v_cache.dtype == out.dtype and q.dtype in (torch.bfloat16, torch.float32)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == Dh and H % KVH == 0, (q.shape, k_cache.shape)
    # q may be a view of the fused qkv rows: heads contiguous, rows any distance apart.
    assert q.stride(2) == 1 and q.stride(1) == Dh and out.is_contiguous() and out.shape == q.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slots % block_size == 0
    assert block_tables.dtype == seq_lens.dtype == torch.int32 and block_tables.is_contiguous()
    assert block_tables.shape[0] >= D and seq_lens.shape[0] >= D and seq_lens.is_contiguous()
    fn = lib.paged_decode_bf16 if q.dtype == torch.bfloat16 else lib.paged_decode_f32
    args = (q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), block_tables.data_ptr(),
            seq_lens.data_ptr(), block_tables.shape[1], H, KVH, Dh, block_size, slots, scale)
    build.run(fn, args, D * KVH)


def cpu_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: CpuAttentionMetadata, scale: float) -> torch.Tensor:
    """engine.attention.paged_attention's contract: decodes through the C kernel, prefill
    chunks through the C prefill kernel (kernels/cpu/prefill.c; the "cpu" backend is only
    chosen where both build; bf16 chunks on AMX tiles where the CPU has them,
    prefill_amx.c), or SDPA for shapes it does not take. q may be a view of the
    fused qkv rows."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    D = meta.num_decodes
    if D:
        assert meta.block_tables is not None and meta.seq_lens is not None, "metadata lacks the ragged form"
        cpu_decode_attention(q[:D], k_cache, v_cache, out[:D], meta.block_tables, meta.seq_lens,
                             meta.block_size, scale)
    if meta.prefills:
        if prefill_amx.supports(q, k_cache):
            prefill_amx.amx_prefill_attention(q, k_cache, v_cache, meta, scale, out)
        elif prefill.supports(q, k_cache):
            prefill.cpu_prefill_attention(q, k_cache, v_cache, meta, scale, out)
        else:
            prefill_attention(q, k_cache, v_cache, meta, scale, out)
    return out
