"""KV cache write: the step's new keys and values into their slots.

Cache layout per layer: `[num_kv_heads, num_slots, head_dim]` (slot = block * block_size +
offset); k/v: `[T, num_kv_heads, head_dim]`; `slot_mapping[t]` is token t's slot (a
negative slot means "do not store", for padded batches). One program per token stores
all its heads, keys and values, so a step is one launch per layer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..torch.attention import write_kv as reference_write_kv  # the torch path the CPU engine runs

__all__ = ["triton_write_kv", "reference_write_kv"]


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_ch, stride_cs,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    # A copy: no arithmetic, so values move bit for bit in every dtype.
    k = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = offs_h[:, None].to(tl.int64) * stride_ch + slot * stride_cs + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def triton_write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Same contract as `engine.attention.write_kv`."""
    T, KVH, D = k.shape
    assert v.shape == k.shape, (v.shape, k.shape)
    assert k_cache.dim() == 3 and k_cache.shape[0] == KVH and k_cache.shape[2] == D, (k_cache.shape, k.shape)
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, (k.dtype, v.dtype, k_cache.dtype)
    assert slot_mapping.shape == (T,) and slot_mapping.dtype in (torch.int32, torch.int64), slot_mapping
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(2) == 1, "head_dim must be contiguous"
    assert k.device == k_cache.device == slot_mapping.device
    if T == 0:
        return
    _kv_write_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        NUM_KV_HEADS=KVH, HEAD_DIM=D, BLOCK_H=triton.next_power_of_2(KVH), BLOCK_D=triton.next_power_of_2(D),
        num_warps=1 if KVH * D <= 512 else 4,
    )
