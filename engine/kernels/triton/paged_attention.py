"""Paged attention over one ragged batch, as a single Triton launch.

Inputs are `RaggedAttentionMetadata`: `query_start_loc [B+1]` (each
sequence's query rows are contiguous), `seq_lens [B]` (context length after this step,
the step's own K/V already written) and `block_tables [B, max_blocks]`. Query row i of a
sequence with n query rows and context L sits at position L - n + i and attends to
positions 0 .. L - n + i of its own sequence: decodes (n = 1) and prefill chunks
(any n, any cached prefix) are the same case.

Work split: one program per (query tile of one sequence, KV head). A query tile is
BLOCK_Q query rows times the G = heads / kv_heads query heads sharing that KV head,
flattened into BLOCK_M = BLOCK_Q * G matrix rows (row m = query m // G, head m % G), so
GQA reads every K/V tile once for all its query heads and a decode still fills a
tensor-core tile. The program walks the sequence's KV positions in BLOCK_N tiles, maps
each position through the block table to its slot (any block size), and keeps an online
softmax (running max, running sum, rescaled accumulator, in fp32, base 2).

Programs find their sequence without any host-side index: sequence b owns global tiles
starting at `query_start_loc[b] // BLOCK_Q + b` (there are at most
`T // BLOCK_Q + B` tiles), found by binary search; surplus programs exit at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..torch.attention import RaggedAttentionMetadata
from ..torch.attention import paged_attention as reference_paged_attention  # the torch path (CPU engine)
from ..torch.attention import reference_attention  # plain fp32 loop, the oracle of both

__all__ = ["triton_paged_attention", "reference_paged_attention", "reference_attention", "attention_config"]

LOG2E = 1.4426950408889634


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The last sequence b whose first tile `query_start_loc[b] // BLOCK_Q + b` is <= tile."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    num_seqs, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_cs, stride_bt,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (tokens per block), any positive int
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,  # head_dim and its power-of-two padding
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 inputs, "tf32" for 16-bit
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = tile - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # position of the sequence's first query row

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_mask = offs_d < HEAD_DIM
    q_idx = local * BLOCK_Q + offs_m // GROUP  # query row within the sequence
    head = kvh * GROUP + offs_m % GROUP
    row_mask = (offs_m // GROUP < BLOCK_Q) & (q_idx < q_len)
    q_pos = first_pos + q_idx
    q_rows = (q_start + q_idx).to(tl.int64)

    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: padding rows never make NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)

    # Keys this tile needs: up to the position of its last query row.
    kv_end = tl.minimum(seq_len, first_pos + (local + 1) * BLOCK_Q)
    cache_head = kvh.to(tl.int64) * stride_ch
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    offs_n0 = tl.arange(0, BLOCK_N)
    for start in range(0, kv_end, BLOCK_N):
        offs_n = start + offs_n0
        n_mask = offs_n < kv_end
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + offs_n % BLOCK_SIZE
        kv_off = cache_head + slot[:, None] * stride_cs + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    l_i = tl.where(row_mask, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def attention_config(num_tokens: int, num_seqs: int, group: int, head_dim: int) -> dict:
    """Tile sizes for one launch. Power-of-two tiles, every tl.dot dimension >= 16."""
    # All decodes (one query row each): a tile is one query's G heads, padded to 16 rows.
    # Otherwise tiles of 64 rows, so a prefill chunk reads each K/V tile once per 64 // G queries.
    rows = 16 if num_tokens == num_seqs else 64
    block_m = max(rows, triton.next_power_of_2(group))
    return {"BLOCK_M": block_m, "BLOCK_Q": block_m // group, "BLOCK_N": 64 if head_dim <= 128 else 32,
            "num_warps": 4, "num_stages": 2}


def triton_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: RaggedAttentionMetadata, scale: float, config: dict | None = None) -> torch.Tensor:
    """Same contract as `engine.attention.paged_attention`: q [T, heads, head_dim] -> same shape.

    `config` overrides `attention_config` (the benchmark sweeps it)."""
    T, H, D = q.shape
    KVH = k_cache.shape[0]
    qsl, seq_lens, tables = meta.query_start_loc, meta.seq_lens, meta.block_tables
    assert qsl is not None and seq_lens is not None and tables is not None, "metadata lacks the ragged form"
    B = seq_lens.shape[0]
    assert k_cache.dim() == 3 and k_cache.shape[2] == D and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape)
    assert H % KVH == 0, f"{H} query heads are not a multiple of {KVH} KV heads"
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype)
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride() == k_cache.stride(), "head_dim contiguous"
    assert qsl.shape == (B + 1,) and tables.dim() == 2 and tables.shape[0] == B, (qsl.shape, seq_lens.shape, tables.shape)
    assert qsl.dtype == seq_lens.dtype == tables.dtype == torch.int32, (qsl.dtype, seq_lens.dtype, tables.dtype)
    assert tables.stride(1) == 1, "block table rows must be contiguous"
    assert q.device == k_cache.device == qsl.device == seq_lens.device == tables.device
    out = torch.empty_like(q)
    if T == 0:
        return out
    G = H // KVH
    cfg = attention_config(T, B, G, D) | (config or {})
    assert cfg["BLOCK_M"] >= 16 and cfg["BLOCK_N"] >= 16 and cfg["BLOCK_Q"] * G <= cfg["BLOCK_M"], cfg
    grid = (T // cfg["BLOCK_Q"] + B, KVH)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, qsl, seq_lens, tables,
        B, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        tables.stride(0),
        BLOCK_SIZE=meta.block_size, GROUP=G, HEAD_DIM=D, HEAD_DIM_P=max(16, triton.next_power_of_2(D)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **cfg,
    )
    return out


def attention_flops_bytes(meta_seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                          itemsize: int) -> tuple[float, float]:
    """(FLOPs, bytes moved) of one batch: `meta_seqs` = (context length, query rows) per sequence.

    FLOPs count the causal score and value matmuls (2 * 2 * visible keys * head_dim per
    query head); bytes count q and out once and each sequence's K/V once per KV head."""
    flops = bytes_ = 0.0
    for ctx, n in meta_seqs:
        visible = sum(ctx - n + i + 1 for i in range(n))
        flops += 4.0 * visible * head_dim * num_heads
        bytes_ += (2 * n * num_heads + 2 * ctx * num_kv_heads) * head_dim * itemsize
    return flops, bytes_

