"""The AMX prefill-attention kernel (prefill_amx.c) for bf16 on Xeons with AMX tiles.

Same contract and work items as prefill.c, which serves every other dtype, head size
and CPU. Its reference is the fp32 per-token loop `engine.attention.reference_attention`
(the tests), against which it rounds like torch's bf16 SDPA: the softmax weights go to
bf16 before P V.
"""
from __future__ import annotations

import functools

import torch

from . import amx, build, prefill
from .metadata import CpuAttentionMetadata

K_STEP = 32  # head dims per tile step


def load_library():
    return build.load("prefill_amx.c", {"paged_prefill_amx": prefill._ARGTYPES})


@functools.cache
def supported() -> bool:
    """The kernel builds here and this process may use the CPU's AMX tiles."""
    return load_library() is not None and amx.supported()


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this kernel takes these shapes here (else prefill.c does): prefill.c's
    shapes in bf16, head dims in whole tile steps."""
    return (q.dtype == torch.bfloat16 and q.shape[2] % K_STEP == 0 and q.shape[1] % k_cache.shape[0] == 0
            and prefill.supports(q, k_cache) and supported())


def amx_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: CpuAttentionMetadata,
                          scale: float, out: torch.Tensor) -> None:
    """The prefill chunks' rows of `out` ([T, heads, head_dim]), as `prefill.cpu_prefill_attention`."""
    lib = load_library()
    assert lib is not None and supports(q, k_cache), (q.dtype, q.shape, k_cache.shape)
    T, H, Dh = q.shape
    KVH, slots = k_cache.shape[0], k_cache.shape[1]
    assert k_cache.dtype == v_cache.dtype == out.dtype == torch.bfloat16
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == Dh and k_cache.is_contiguous() and v_cache.is_contiguous()
    # q may be a view of the fused qkv rows: heads contiguous, rows any distance apart.
    assert q.stride(2) == 1 and q.stride(1) == Dh and out.is_contiguous() and out.shape == q.shape
    tables = meta.block_tables
    assert tables is not None and tables.dtype == torch.int32 and tables.is_contiguous()
    items = prefill.prefill_items(meta, H // KVH)
    if not items.shape[0]:
        return
    args = (q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), items.data_ptr(),
            tables.data_ptr(), tables.shape[1], H, KVH, Dh, meta.block_size, slots, scale)
    build.run(lib.paged_prefill_amx, args, items.shape[0] * KVH)
