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

from ..backend import AttentionMetadata


def head_major_rows(blocks: torch.Tensor, kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Block ids -> rows of a cache viewed as [kv_heads * num_blocks, block_size * head_dim],
    in [head, block] order."""
    heads = torch.arange(kv_heads, device=blocks.device)[:, None] * num_blocks
    return (heads + blocks[None, :]).flatten()


@dataclass
class PrefillChunk:
    q_start: int  # first row of this chunk in the batch
    q_len: int
    start_pos: int  # position of the chunk's first token
    blocks: torch.Tensor  # the sequence's block table, covering start_pos + q_len tokens
    mask: torch.Tensor | None  # additive [q_len, ctx] or None when plainly causal
    _flat: torch.Tensor | None = None

    def cache_rows(self, kv_heads: int, num_blocks: int) -> torch.Tensor:
        if self._flat is None:
            self._flat = head_major_rows(self.blocks, kv_heads, num_blocks)
        return self._flat


@dataclass
class DecodeGroup:
    """Decodes whose contexts span a similar number of blocks, computed together.

    Padding every decode to the longest context in the batch would make a heavy-tailed
    batch gather and multiply several times the KV it needs; groups bound that waste.
    """

    rows: torch.Tensor | None  # the group's query rows in the batch; None: rows start..start+count
    start: int
    count: int
    length: int  # padded context length: whole blocks
    blocks: torch.Tensor  # [count * blocks per decode] block ids, padded with block 0 (masked out)
    mask: torch.Tensor | None  # [count, 1, length] additive; None when no position is padding
    _flat: torch.Tensor | None = None

    def cache_rows(self, kv_heads: int, num_blocks: int) -> torch.Tensor:
        """Rows of the cache viewed as [kv_heads * num_blocks, block_size * head_dim], in
        [head, decode, block] order: one index_select over dim 0 copies whole contiguous
        blocks (a gather over dim 1 of the 4-d view measured 2x slower)."""
        if self._flat is None:
            self._flat = head_major_rows(self.blocks, kv_heads, num_blocks)
        return self._flat


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """The torch path's form: decodes computed in groups, prefill chunks one SDPA each."""

    # (start_pos, 1, block ids) per decode, for the groups built on first use.
    decodes: list[tuple[int, int, list[int]]] = field(default_factory=list)
    device: torch.device | str = "cpu"
    _decode_groups: list[DecodeGroup] | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)

    @property
    def decode_groups(self) -> list[DecodeGroup]:
        if self._decode_groups is None:
            self._decode_groups = [_decode_group(self.decodes, idx, self.block_size, self.device)
                                   for idx in group_decodes([len(b) for _, _, b in self.decodes])] if self.decodes else []
        return self._decode_groups


@dataclass
class RaggedAttentionMetadata(AttentionMetadata):
    """The generic ragged form GPU kernels take: per sequence, its first query row, its
    context length after this step, and its block table."""

    query_start_loc: torch.Tensor | None = None  # [B + 1] int32
    seq_lens: torch.Tensor | None = None  # [B] int32
    block_tables: torch.Tensor | None = None  # [B, max blocks] int32, padded with 0


# Cost model for splitting decodes into groups, per layer: a group's fixed cost (about a
# dozen torch calls) against the cost of one padded block of one decode (its K and V
# gather, two matmul slices, softmax). Measured on SmolLM2 shapes: ~165 us vs ~1.3 us.
GROUP_COST_BLOCKS = 128


def group_decodes(num_blocks: list[int]) -> list[list[int]]:
    """Partition decode indices into groups minimising fixed + padded cost.

    Exact dynamic programming over the distinct block counts (sorted), so it is cheap:
    contexts span at most max_model_len / block_size distinct values.
    """
    order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__)
    values = sorted(set(num_blocks))
    counts = [0] * len(values)
    where = {v: i for i, v in enumerate(values)}
    for n in num_blocks:
        counts[where[n]] += 1
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    best = [0.0] + [float("inf")] * len(values)
    cut = [0] * (len(values) + 1)
    for j in range(1, len(values) + 1):
        for i in range(j):  # group = values[i..j-1], padded to values[j-1]
            cost = best[i] + GROUP_COST_BLOCKS + (prefix[j] - prefix[i]) * values[j - 1]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    bounds, j = [], len(values)
    while j:
        bounds.append((prefix[cut[j]], prefix[j]))
        j = cut[j]
    return [order[a:b] for a, b in reversed(bounds)]


def _tables_and_slots(seqs: list[tuple[int, int, list[int]]], block_size: int
                      ) -> tuple[list[list[int]], torch.Tensor, int]:
    """(block table per sequence, slot mapping, number of decodes: the leading one-token
    sequences). Plain lists until one tensor each: a decode step's metadata is built
    every step for every sequence, and a handful of small torch calls per sequence cost
    a 64-sequence step ~2 ms."""
    tables, slots, num_decodes = [], [], 0
    for start, n, blocks in seqs:
        b = blocks[:-(-(start + n) // block_size)]
        if n == 1:
            slots.append(b[start // block_size] * block_size + start % block_size)
            if num_decodes == len(tables):  # every sequence before it a decode too
                num_decodes += 1
        else:
            slots.extend(b[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        tables.append(b)
    return tables, torch.tensor(slots, dtype=torch.long), num_decodes


def _padded(tables: list[list[int]], width: int, dtype: torch.dtype) -> torch.Tensor:
    """[len(tables), width] block ids, each row padded with block 0."""
    return torch.tensor([[*b] + [0] * (width - len(b)) for b in tables], dtype=dtype)


def ragged_tables(seqs: list[tuple[int, int, list[int]]], device: torch.device | str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query_start_loc, seq_lens, block_tables) of `RaggedAttentionMetadata`."""
    lens = [n for _, n, _ in seqs]
    query_start_loc = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    seq_lens = torch.tensor([s + n for s, n, _ in seqs], dtype=torch.int32).to(device)
    tables = _padded([b for _, _, b in seqs], max(len(b) for _, _, b in seqs), torch.int32)
    return query_start_loc, seq_lens, tables.to(device)


def build_ragged_metadata(seqs: list[tuple[int, int, list[int]]], block_size: int, dtype: torch.dtype,
                          device: torch.device | str = "cpu") -> RaggedAttentionMetadata:
    """`seqs`: (start_pos, num_new_tokens, block_ids) in batch order, decodes first."""
    _, slots, num_decodes = _tables_and_slots(seqs, block_size)
    qsl, seq_lens, tables = ragged_tables(seqs, device)
    return RaggedAttentionMetadata(slots.to(device), block_size, num_decodes, qsl, seq_lens, tables)


def build_metadata(seqs: list[tuple[int, int, list[int]]], block_size: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu", cls: type[TorchAttentionMetadata] = TorchAttentionMetadata,
                   **extra) -> TorchAttentionMetadata:
    """`seqs`: (start_pos, num_new_tokens, block_ids) in batch order, decodes first.
    `cls` and `extra`: a subclass adding its own fields (the C kernels' form)."""
    tables, slots, num_decodes = _tables_and_slots(seqs, block_size)
    decodes = [(s, n, b) for (s, n, _), b in zip(seqs[:num_decodes], tables)]
    meta = cls(slot_mapping=slots.to(device), block_size=block_size, num_decodes=num_decodes, decodes=decodes,
               device=device, **extra)
    q_start = num_decodes
    for (s, n, _), b in zip(seqs[num_decodes:], tables[num_decodes:]):
        mask = None
        if s:
            # Query i sits at position s + i and sees keys 0..s+i.
            allowed = torch.arange(s + n)[None, :] <= (torch.arange(n)[:, None] + s)
            mask = torch.zeros(n, s + n, dtype=dtype).masked_fill_(~allowed, float("-inf")).to(device)
        meta.prefills.append(PrefillChunk(q_start, n, s, torch.tensor(b, dtype=torch.long, device=device), mask))
        q_start += n
    return meta


def _decode_group(decodes: list[tuple[int, int, list[int]]], idx: list[int], block_size: int,
                  device: torch.device | str) -> DecodeGroup:
    nb = max(len(decodes[i][2]) for i in idx)
    table = _padded([decodes[i][2] for i in idx], nb, torch.long)
    mask = torch.full((len(idx), 1, nb * block_size), float("-inf"))
    for r, i in enumerate(idx):
        s, n, _ = decodes[i]
        mask[r, 0, : s + n] = 0.0
    padded = any(decodes[i][0] + 1 != nb * block_size for i in idx)
    contiguous = idx == list(range(idx[0], idx[0] + len(idx)))
    rows = None if contiguous else torch.tensor(idx, dtype=torch.long, device=device)
    return DecodeGroup(rows, idx[0], len(idx), nb * block_size, table.flatten().to(device),
                       mask.to(device) if padded else None)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's keys/values ([T, kv_heads, head_dim]) into their slots."""
    k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: TorchAttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim]; K/V already written for this step."""
    out = torch.empty_like(q)
    for g in meta.decode_groups:
        out_rows = _decode_attention(q[g.start:g.start + g.count] if g.rows is None else q.index_select(0, g.rows),
                                     k_cache, v_cache, g, meta.block_size, scale)
        if g.rows is None:
            out[g.start:g.start + g.count] = out_rows
        else:
            out.index_copy_(0, g.rows, out_rows)
    prefill_attention(q, k_cache, v_cache, meta, scale, out)
    return out


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TorchAttentionMetadata,
                      scale: float, out: torch.Tensor) -> None:
    """The prefill chunks' rows of `out`: one SDPA call per chunk over its gathered blocks."""
    Dh, KVH = q.shape[2], k_cache.shape[0]
    flat_k, flat_v = k_cache.view(-1, meta.block_size * Dh), v_cache.view(-1, meta.block_size * Dh)
    num_blocks = k_cache.shape[1] // meta.block_size
    for c in meta.prefills:
        qc = q[c.q_start:c.q_start + c.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, n, Dh]
        ctx = c.start_pos + c.q_len
        rows = c.cache_rows(KVH, num_blocks)
        k = flat_k.index_select(0, rows).view(1, KVH, -1, Dh)[:, :, :ctx]  # [1, KVH, ctx, Dh]
        v = flat_v.index_select(0, rows).view(1, KVH, -1, Dh)[:, :, :ctx]
        o = F.scaled_dot_product_attention(qc, k, v, attn_mask=c.mask, is_causal=c.mask is None,
                                           scale=scale, enable_gqa=True)
        out[c.q_start:c.q_start + c.q_len] = o[0].transpose(0, 1)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup,
                      block_size: int, scale: float) -> torch.Tensor:
    """One decode group: q [D, heads, head_dim] -> [D, heads, head_dim], two batched matmuls."""
    D, H, Dh = q.shape
    KVH, L = k_cache.shape[0], g.length
    G = H // KVH
    rows = g.cache_rows(KVH, k_cache.shape[1] // block_size)
    k = k_cache.view(-1, block_size * Dh).index_select(0, rows).view(KVH * D, L, Dh)
    v = v_cache.view(-1, block_size * Dh).index_select(0, rows).view(KVH * D, L, Dh)
    qd = q.view(D, KVH, G, Dh).transpose(0, 1).reshape(KVH * D, G, Dh)
    s = torch.bmm(qd, k.transpose(1, 2)).view(KVH, D, G, L).float() * scale
    if g.mask is not None:
        s += g.mask
    p = torch.softmax(s, dim=-1).to(q.dtype).view(KVH * D, G, L)
    return torch.bmm(p, v).view(KVH, D, G, Dh).transpose(0, 1).reshape(D, H, Dh)


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
