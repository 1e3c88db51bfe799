"""Paged attention over one ragged batch: the torch path the CPU engine runs.

KV cache layout per layer: `[num_kv_heads, num_slots, head_dim]` (slot = block * block_size
+ offset). Head-major so a gather of one sequence's slots is already in the layout a
batched matmul wants, with no transposing copies.

The batch puts decodes (one query token each) first: they are computed together with
one gather and two batched matmuls. Prefill chunks follow, one SDPA call each.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    q_start: int  # first row of this chunk in the batch
    q_len: int
    start_pos: int  # position of the chunk's first token
    blocks: torch.Tensor  # the sequence's block table, covering start_pos + q_len tokens
    mask: torch.Tensor | None  # additive [q_len, ctx] or None when plainly causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    block_size: int = 16
    num_decodes: int = 0
    decode_len: int = 0  # padded context length of the decode group (whole blocks)
    # [num_decodes * blocks per decode] block ids, padded with block 0 (masked out).
    # Gathering whole blocks copies contiguous runs of block_size * head_dim values,
    # many times faster than gathering single slots.
    decode_blocks: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, decode_len] additive
    prefills: list[PrefillChunk] = field(default_factory=list)
    # The same batch in the generic ragged form GPU kernels take: per sequence, its
    # first query row, its context length after this step, and its block table.
    query_start_loc: torch.Tensor | None = None  # [B + 1] int32
    seq_lens: torch.Tensor | None = None  # [B] int32
    block_tables: torch.Tensor | None = None  # [B, max blocks] int32, padded with 0


def build_metadata(seqs: list[tuple[int, int, list[int]]], block_size: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> AttentionMetadata:
    """`seqs`: (start_pos, num_new_tokens, block_ids) in batch order, decodes first."""
    slot_chunks, decodes, prefills = [], [], []
    for start, n, blocks in seqs:
        nb = -(-(start + n) // block_size)
        b = torch.tensor(blocks[:nb], dtype=torch.long)
        pos = torch.arange(start, start + n)
        slot_chunks.append(b[pos // block_size] * block_size + pos % block_size)
        (decodes if n == 1 and not prefills else prefills).append((start, n, b, None))
    meta = AttentionMetadata(slot_mapping=torch.cat(slot_chunks).to(device), block_size=block_size)
    lens = [n for _, n, _ in seqs]
    meta.query_start_loc = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    meta.seq_lens = torch.tensor([s + n for s, n, _ in seqs], dtype=torch.int32).to(device)
    tables = torch.zeros(len(seqs), max(len(b) for _, _, b in seqs), dtype=torch.int32)
    for i, (_, _, b) in enumerate(seqs):
        tables[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
    meta.block_tables = tables.to(device)
    if decodes:
        nb = max(len(b) for _, _, b, _ in decodes)
        table = torch.zeros(len(decodes), nb, dtype=torch.long)
        mask = torch.full((len(decodes), 1, nb * block_size), float("-inf"))
        for i, (s, n, b, _) in enumerate(decodes):
            table[i, : len(b)] = b
            mask[i, 0, : s + n] = 0.0
        meta.num_decodes, meta.decode_len = len(decodes), nb * block_size
        meta.decode_blocks = table.flatten().to(device)
        meta.decode_mask = mask.to(device)
    q_start = len(decodes)
    for s, n, b, _ in prefills:
        mask = None
        if s:
            # Query i sits at position s + i and sees keys 0..s+i.
            allowed = torch.arange(s + n)[None, :] <= (torch.arange(n)[:, None] + s)
            mask = torch.zeros(n, s + n, dtype=dtype).masked_fill_(~allowed, float("-inf")).to(device)
        meta.prefills.append(PrefillChunk(q_start, n, s, b.to(device), mask))
        q_start += n
    return meta


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's keys/values ([T, kv_heads, head_dim]) into their slots."""
    k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim]; K/V already written for this step."""
    T, H, Dh = q.shape
    KVH = k_cache.shape[0]
    out = torch.empty_like(q)
    if meta.num_decodes:
        D, L, G = meta.num_decodes, meta.decode_len, H // KVH
        qd = q[:D].view(D, KVH, G, Dh).transpose(0, 1).reshape(KVH * D, G, Dh)
        bs = meta.block_size
        kb, vb = k_cache.view(KVH, -1, bs, Dh), v_cache.view(KVH, -1, bs, Dh)
        k = kb.index_select(1, meta.decode_blocks).view(KVH * D, L, Dh)
        v = vb.index_select(1, meta.decode_blocks).view(KVH * D, L, Dh)
        s = torch.bmm(qd, k.transpose(1, 2)).view(KVH, D, G, L).float() * scale
        p = torch.softmax(s + meta.decode_mask, dim=-1).to(q.dtype).view(KVH * D, G, L)
        o = torch.bmm(p, v).view(KVH, D, G, Dh).transpose(0, 1).reshape(D, H, Dh)
        out[:D] = o
    kb_ = k_cache.view(KVH, -1, meta.block_size, Dh)
    vb_ = v_cache.view(KVH, -1, meta.block_size, Dh)
    for c in meta.prefills:
        qc = q[c.q_start:c.q_start + c.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, n, Dh]
        ctx = c.start_pos + c.q_len
        k = kb_.index_select(1, c.blocks).view(1, KVH, -1, Dh)[:, :, :ctx]  # [1, KVH, ctx, Dh]
        v = vb_.index_select(1, c.blocks).view(1, KVH, -1, Dh)[:, :, :ctx]
        o = F.scaled_dot_product_attention(qc, k, v, attn_mask=c.mask, is_causal=c.mask is None,
                                           scale=scale, enable_gqa=True)
        out[c.q_start:c.q_start + c.q_len] = o[0].transpose(0, 1)
    return out


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        seqs: list[tuple[int, int, list[int]]], block_size: int, scale: float) -> torch.Tensor:
    """Plain per-token loop in fp32: the oracle the fast paths and kernels are tested against."""
    T, H, Dh = q.shape
    KVH = k_cache.shape[0]
    out = torch.empty(T, H, Dh, dtype=torch.float32)
    row = 0
    for start, n, blocks in seqs:
        pos = torch.arange(start + n)
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        k = k_cache[:, slots].float().repeat_interleave(H // KVH, dim=0)  # [H, ctx, Dh]
        v = v_cache[:, slots].float().repeat_interleave(H // KVH, dim=0)
        for i in range(n):
            ctx = start + i + 1
            s = torch.einsum("hd,hld->hl", q[row + i].float(), k[:, :ctx]) * scale
            out[row + i] = torch.einsum("hl,hld->hd", torch.softmax(s, -1), v[:, :ctx])
        row += n
    return out.to(q.dtype)
