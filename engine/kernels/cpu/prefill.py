"""The C prefill-attention kernel (prefill.c): causal attention of each prefill chunk
over its paged context, read in place from the cache.

Its reference is the fp32 per-token loop `engine.attention.reference_attention` (the
tests) and the torch path's SDPA (`engine.attention.prefill_attention`), which runs
where the kernel cannot be built.
"""
from __future__ import annotations

import ctypes

import torch

from . import build
from .metadata import CpuAttentionMetadata

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_ARGTYPES = [_P, _L, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _L, _F, _I, _I]
MAX_QG = 64  # query vectors per work item (prefill.c MAX_QG)
MAX_HEAD_DIM = 256
# Query vectors per work item (rows x query heads sharing a KV head): enough to reuse
# each K and V row many times, few enough that a chunk still splits over the threads.
ITEM_QUERIES = 48


def load_library() -> ctypes.CDLL | None:
    return build.load("prefill.c", {"paged_prefill_bf16": _ARGTYPES, "paged_prefill_f32": _ARGTYPES})


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    heads, kv_heads, head_dim = q.shape[1], k_cache.shape[0], q.shape[2]
    return heads // kv_heads <= MAX_QG and head_dim <= MAX_HEAD_DIM and q.dtype in (torch.bfloat16, torch.float32)


def prefill_items(meta: CpuAttentionMetadata, group: int) -> torch.Tensor:
    """int32 [items, 4]: (first batch row, rows, position of the first row, sequence index
    into meta.block_tables) per block of query rows of each chunk; made once per step."""
    items = meta.work_items
    if items is None:
        rows = max(1, ITEM_QUERIES // group)
        flat = [(c.q_start + r, min(rows, c.q_len - r), c.start_pos + r, meta.num_decodes + i)
                for i, c in enumerate(meta.prefills) for r in range(0, c.q_len, rows)]
        items = torch.tensor(flat, dtype=torch.int32).view(-1, 4)
        meta.work_items = items
    return items


def cpu_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: CpuAttentionMetadata,
                          scale: float, out: torch.Tensor) -> None:
    """The prefill chunks' rows of `out` ([T, heads, head_dim]), as `prefill_attention`."""
    lib = load_library()
    assert lib is not None, "load_library() returned None: use the torch path"
    T, H, Dh = q.shape
    KVH, slots = k_cache.shape[0], k_cache.shape[1]
    assert supports(q, k_cache) and H % KVH == 0, (q.shape, k_cache.shape)
    assert q.dtype == k_cache.dtype == v_cache.dtype == out.dtype
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == Dh and k_cache.is_contiguous() and v_cache.is_contiguous()
    # q may be a view of the fused qkv rows: heads contiguous, rows any distance apart.
    assert q.stride(2) == 1 and q.stride(1) == Dh and out.is_contiguous() and out.shape == q.shape
    tables = meta.block_tables
    assert tables is not None and tables.dtype == torch.int32 and tables.is_contiguous()
    items = prefill_items(meta, H // KVH)
    if not items.shape[0]:
        return
    fn = lib.paged_prefill_bf16 if q.dtype == torch.bfloat16 else lib.paged_prefill_f32
    args = (q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), items.data_ptr(),
            tables.data_ptr(), tables.shape[1], H, KVH, Dh, meta.block_size, slots, scale)
    build.run(fn, args, items.shape[0] * KVH)
