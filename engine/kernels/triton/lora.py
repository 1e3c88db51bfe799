"""Batched multi-LoRA: shrink `s = x·Aᵀ` and expand `out += s·Bᵀ` over adapter segments.

The torch path (`lora.torch_backend.LoRABatch`) loops over segments in Python. Here one launch
computes a whole projection group ("qkv", "o", "gate_up", "down") for every segment of
the batch, and every projection of the group at once: the shrink grid is
(row tile, module[, K split]) and the expand grid is (row tile, output-column tile),
where a column tile lies inside one module, so it knows whose rank and B to use.

Weights live stacked per device slot (`StackedLoRAWeights`), built from the same
`PackedGroup` data the torch path uses, once per slot load:
  a[group]: [layers, slots, modules, max_rank, in_features]  (A rows, zero padded)
  b[group]: [layers, slots, max_rank, out_features of the group]  (Bᵀ·scale, zero padded)
  ranks[group]: [layers, slots, modules] int32 (0: the adapter does not target it)
Heterogeneous ranks cost nothing extra in memory traffic: loads are masked to each
(slot, module)'s rank, and a launch's rank tile is the batch's largest rank, padded to
a power of two >= 16 (the `tl.dot` minimum). Rows outside every segment (base-model
requests) belong to no tile and are never read or written.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...lora.backend import LoRABackend
from ...lora.epilogue import EpilogueStacks
from ...lora.packing import GROUPS, PackedGroup

__all__ = ["StackedLoRAWeights", "TritonLoRABatch", "lora_shrink", "lora_expand", "row_tiles",
           "reference_lora_shrink", "reference_lora_expand"]


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, ranks_ptr, tiles_ptr, s_ptr, K,
                        stride_xt, stride_as, stride_am, stride_ar, stride_st, stride_sm,
                        NUM_MODULES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_t = tl.program_id(0)
    m = tl.program_id(1)
    pid_k = tl.program_id(2)
    row0 = tl.load(tiles_ptr + pid_t * 3)
    row1 = tl.load(tiles_ptr + pid_t * 3 + 1)
    slot = tl.load(tiles_ptr + pid_t * 3 + 2)
    rank = tl.load(ranks_ptr + slot * NUM_MODULES + m)
    if rank == 0:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < row1
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k0 = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xt
    a_base = a_ptr + slot.to(tl.int64) * stride_as + m * stride_am + offs_r[None, :] * stride_ar
    # This program's share of the input features, in whole BLOCK_K steps.
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    k_hi = tl.minimum(K, k_lo + k_span)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + offs_k0
        k_mask = offs_k < k_hi
        x = tl.load(x_rows + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        a = tl.load(a_base + offs_k[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(x, a, input_precision=PRECISION)  # [BLOCK_M, BLOCK_R]
    s_off = s_ptr + rows.to(tl.int64)[:, None] * stride_st + m * stride_sm + offs_r[None, :]
    s_mask = row_mask[:, None] & r_mask[None, :]
    if SPLIT_K == 1:
        tl.store(s_off, acc, mask=s_mask)
    else:
        tl.atomic_add(s_off, acc, mask=s_mask)


@triton.jit
def _lora_expand_kernel(s_ptr, b_ptr, ranks_ptr, tiles_ptr, col_tiles_ptr, out_ptr,
                        epi_ptr, scale_ptr, shift_ptr,
                        stride_st, stride_sm, stride_bs, stride_br, stride_ot, stride_es,
                        NUM_MODULES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, HAS_EPILOGUE: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    row0 = tl.load(tiles_ptr + pid_t * 3)
    row1 = tl.load(tiles_ptr + pid_t * 3 + 1)
    slot = tl.load(tiles_ptr + pid_t * 3 + 2)
    m = tl.load(col_tiles_ptr + pid_n * 3)  # the module this column tile belongs to
    col0 = tl.load(col_tiles_ptr + pid_n * 3 + 1)
    col_end = tl.load(col_tiles_ptr + pid_n * 3 + 2)  # the module's last column + 1
    rank = tl.load(ranks_ptr + slot * NUM_MODULES + m)
    if rank == 0:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < row1
    cols = col0 + tl.arange(0, BLOCK_N)
    col_mask = cols < col_end
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    rows64 = rows.to(tl.int64)
    s = tl.load(s_ptr + rows64[:, None] * stride_st + m * stride_sm + offs_r[None, :],
                mask=row_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br + cols[None, :],
                mask=r_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    delta = tl.dot(s, b, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    o_off = out_ptr + rows64[:, None] * stride_ot + cols[None, :]
    o_mask = row_mask[:, None] & col_mask[None, :]
    o = tl.load(o_off, mask=o_mask, other=0.0).to(tl.float32) + delta
    if HAS_EPILOGUE:
        # DoRA / lora_bias (lora/epilogue.py): o * scale + shift per output column, fp32.
        if tl.load(epi_ptr + slot) != 0:
            e_off = slot.to(tl.int64) * stride_es + cols
            sc = tl.load(scale_ptr + e_off, mask=col_mask, other=1.0)
            sh = tl.load(shift_ptr + e_off, mask=col_mask, other=0.0)
            o = o * sc[None, :] + sh[None, :]
    tl.store(o_off, o.to(out_ptr.dtype.element_ty), mask=o_mask)


def _precision(dtype: torch.dtype) -> str:
    # 16-bit values are exact in tf32, so tf32 tensor cores lose nothing on them; fp32 needs ieee.
    return "ieee" if dtype == torch.float32 else "tf32"


def rank_tile(max_rank: int) -> int:
    return max(16, triton.next_power_of_2(max_rank))


def row_tiles(segments: list[tuple[int, int, int]], block_m: int, device) -> torch.Tensor:
    """[tiles, 3] int32: (first row, end row, slot), each tile at most block_m rows of one segment."""
    tiles = [(r, min(r + block_m, end), slot) for start, end, slot in segments for r in range(start, end, block_m)]
    return torch.tensor(tiles, dtype=torch.int32).reshape(-1, 3).to(device)


def column_tiles(widths: list[int], block_n: int, device) -> torch.Tensor:
    """[tiles, 3] int32: (module, first column, module's end column) covering every module."""
    out, col = [], 0
    for m, w in enumerate(widths):
        out += [(m, c, col + w) for c in range(col, col + w, block_n)]
        col += w
    return torch.tensor(out, dtype=torch.int32).reshape(-1, 3).to(device)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_k(num_programs: int, k: int, device: torch.device) -> int:
    """K splits so that a small batch (few row tiles) still fills the GPU's SMs."""
    if device.type != "cuda":
        return 1
    target = 2 * _num_sms(device)
    split = 1
    while num_programs * split * 2 <= target and k // (split * 2) >= 512 and split < 16:
        split *= 2
    return split


def lora_shrink(x: torch.Tensor, a: torch.Tensor, ranks: torch.Tensor, tiles: torch.Tensor, block_m: int,
                max_rank: int, split_k: int | None = None, block_k: int = 64) -> torch.Tensor:
    """x [T, K], a [slots, modules, R, K], ranks [slots, modules] -> s [T, modules, rank tile] fp32.

    Only rows inside `tiles` and ranks below each (slot, module)'s rank are written."""
    T, K = x.shape
    S, M, R, K_ = a.shape
    assert K_ == K and ranks.shape == (S, M) and ranks.dtype == torch.int32, (x.shape, a.shape, ranks.shape)
    assert x.dtype == a.dtype and x.dtype in (torch.float16, torch.bfloat16, torch.float32), (x.dtype, a.dtype)
    assert x.stride(1) == 1 and a.stride(3) == 1 and ranks.is_contiguous(), "feature dims must be contiguous"
    assert tiles.dim() == 2 and tiles.shape[1] == 3 and tiles.dtype == torch.int32 and tiles.is_contiguous()
    assert 1 <= max_rank <= R, (max_rank, R)
    assert x.device == a.device == ranks.device == tiles.device
    br = rank_tile(max_rank)
    assert block_m >= 16 and block_k >= 16 and br >= 16
    nt = tiles.shape[0]
    split = split_k or _split_k(nt * M, K, x.device)
    s = (torch.zeros if split > 1 else torch.empty)(T, M, br, dtype=torch.float32, device=x.device)
    if nt:
        _lora_shrink_kernel[(nt, M, split)](
            x, a, ranks, tiles, s, K,
            x.stride(0), a.stride(0), a.stride(1), a.stride(2), s.stride(0), s.stride(1),
            NUM_MODULES=M, BLOCK_M=block_m, BLOCK_R=br, BLOCK_K=block_k, SPLIT_K=split,
            PRECISION=_precision(x.dtype), num_warps=4)
    return s


def lora_expand(s: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor, tiles: torch.Tensor,
                col_tiles: torch.Tensor, out: torch.Tensor, block_m: int, block_n: int,
                epilogue: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """out[rows, cols] += s[rows, module, :rank] @ b[slot, :rank, cols] over `tiles` x `col_tiles`;
    `epilogue` (flags int32 [slots], scale and shift fp32 [slots, N]): then, for slots
    whose flag is set, out = out * scale + shift on those columns."""
    T, M, br = s.shape
    S, R, N = b.shape
    assert s.dtype == torch.float32 and ranks.shape == (S, M) and ranks.dtype == torch.int32, (s.shape, ranks.shape)
    assert out.shape == (T, N) and out.dtype == b.dtype, (out.shape, out.dtype, b.shape, b.dtype)
    assert out.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert s.stride(2) == 1 and b.stride(2) == 1 and out.stride(1) == 1 and ranks.is_contiguous()
    assert col_tiles.dtype == tiles.dtype == torch.int32 and col_tiles.is_contiguous() and tiles.is_contiguous()
    assert br >= 16 and block_m >= 16 and block_n >= 16
    assert s.device == b.device == out.device == tiles.device == col_tiles.device
    if epilogue is not None:
        flags, scale, shift = epilogue
        assert flags.shape == (S,) and flags.dtype == torch.int32 and scale.shape == shift.shape == (S, N)
        assert scale.dtype == shift.dtype == torch.float32 and scale.stride() == shift.stride()
        assert scale.stride(1) == 1 and flags.device == scale.device == shift.device == out.device
    if tiles.shape[0] == 0:
        return
    flags, scale, shift = epilogue if epilogue is not None else (ranks, out, out)  # unread without one
    _lora_expand_kernel[(tiles.shape[0], col_tiles.shape[0])](
        s, b, ranks, tiles, col_tiles, out, flags, scale, shift,
        s.stride(0), s.stride(1), b.stride(0), b.stride(1), out.stride(0), scale.stride(0),
        NUM_MODULES=M, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=br, PRECISION=_precision(out.dtype),
        HAS_EPILOGUE=epilogue is not None, num_warps=4)


# -- torch references on the stacked layout ------------------------------------------
def reference_lora_shrink(x, a, ranks, segments) -> torch.Tensor:
    """fp32 [T, modules, R]; zero outside segments and beyond each rank."""
    T = x.shape[0]
    S, M, R, K = a.shape
    s = torch.zeros(T, M, R, dtype=torch.float32, device=x.device)
    for start, end, slot in segments:
        for m in range(M):
            r = int(ranks[slot, m])
            s[start:end, m, :r] = x[start:end].float() @ a[slot, m, :r].float().T
    return s


def reference_lora_expand(s, b, ranks, widths, segments, out, epilogue=None) -> None:
    M = len(widths)
    for start, end, slot in segments:
        col = 0
        for m in range(M):
            r = int(ranks[slot, m])
            w = widths[m]
            if r:
                o = out[start:end, col:col + w].float() + s[start:end, m, :r].float() @ b[slot, :r, col:col + w].float()
                if epilogue is not None and int(epilogue[0][slot]):
                    o = o * epilogue[1][slot, col:col + w] + epilogue[2][slot, col:col + w]
                out[start:end, col:col + w] = o.to(out.dtype)
            col += w


# -- the engine-facing pieces ----------------------------------------------------------
class StackedLoRAWeights(LoRABackend):
    """The Triton LoRA backend: per-slot adapter weights in the layout the kernels read,
    filled once per slot load, allocated up front for `max_rank`."""

    BLOCK_N = 64
    grows = False  # CUDA graphs read the rows by address

    def __init__(self, num_slots: int, num_layers: int, in_sizes: dict[str, int],
                 out_sizes: dict[str, int], max_rank: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_slots, self.num_layers, self.max_rank = num_slots, num_layers, max_rank
        self.dtype, self.device = dtype, torch.device(device)
        self.widths = {g: [out_sizes[m] for m in mods] for g, mods in GROUPS.items()}
        self.a, self.b, self.ranks, self.col_tiles = {}, {}, {}, {}
        # Host copy of the ranks: [layer][slot] -> largest rank of the group (launch sizing).
        self.host_rank: dict[str, list[list[int]]] = {}
        for g, mods in GROUPS.items():
            n = sum(self.widths[g])
            self.a[g] = torch.zeros(num_layers, num_slots, len(mods), max_rank, in_sizes[g], dtype=dtype, device=device)
            self.b[g] = torch.zeros(num_layers, num_slots, max_rank, n, dtype=dtype, device=device)
            self.ranks[g] = torch.zeros(num_layers, num_slots, len(mods), dtype=torch.int32, device=device)
            self.col_tiles[g] = column_tiles(self.widths[g], self.BLOCK_N, device)
            self.host_rank[g] = [[0] * num_slots for _ in range(num_layers)]
        # DoRA's and lora_bias's per-column maps, fused into the expand (allocated now: graphs read them).
        widths = {g: sum(w) for g, w in self.widths.items()}
        self.epilogues = EpilogueStacks(num_slots, num_layers, widths, self.device, eager=True)

    def nbytes(self) -> int:
        e = self.epilogues
        return sum(t.numel() * t.element_size()
                   for d in (self.a, self.b, self.ranks, e.scale, e.shift, e.flags_t) for t in d.values())

    def epilogue(self, group: str, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`lora_expand`'s epilogue argument for one layer and group."""
        return self.epilogues.layer(group, layer)

    @torch.no_grad()
    def set_slot(self, slot: int, packed: list[dict[str, PackedGroup]]) -> None:
        """Copy one adapter (as `pack_adapter` made it) into `slot`, replacing what was there."""
        assert len(packed) == self.num_layers, (len(packed), self.num_layers)
        self.epilogues.set_slot(slot, packed)
        for g, mods in GROUPS.items():
            starts = {}
            col = 0
            for m, w in enumerate(self.widths[g]):
                starts[col] = m
                col += w
            ranks = torch.zeros(self.num_layers, len(mods), dtype=torch.int32)
            a, b = self.a[g][:, slot], self.b[g][:, slot]
            a.zero_()
            b.zero_()
            for layer, groups in enumerate(packed):
                p = groups.get(g)
                if p is None:
                    continue
                for col, width, r0, r, bm in p.parts:
                    m = starts[col]
                    assert width == self.widths[g][m] and r <= self.max_rank, (g, width, r, self.max_rank)
                    a[layer, m, :r] = p.a[r0:r0 + r]
                    b[layer, :r, col:col + width] = bm.T
                    ranks[layer, m] = r
            self.ranks[g][:, slot] = ranks.to(self.device)
            for layer in range(self.num_layers):
                self.host_rank[g][layer][slot] = int(ranks[layer].max())

    def batch(self, segments: list[tuple[int, int, int]]) -> TritonLoRABatch | None:
        return TritonLoRABatch(self, segments) if segments else None


class TritonLoRABatch:
    """One step's adapter segments; `apply` adds the deltas in place (as `LoRABatch.apply`)."""

    def __init__(self, weights: StackedLoRAWeights, segments: list[tuple[int, int, int]]) -> None:
        self.weights = weights
        self.segments = segments  # (start row, end row, slot), slot >= 0 only
        self.slots = sorted({slot for _, _, slot in segments})
        longest = max((end - start for start, end, _ in segments), default=0)
        # Decode segments are a few rows: 16-row tiles (the tl.dot minimum); prefill: 64.
        self.block_m = 16 if longest <= 16 else 64
        self.tiles = row_tiles(segments, self.block_m, weights.device)
        self.epilogue = any(slot in weights.epilogues.slots for slot in self.slots)

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        w = self.weights
        ranks = w.host_rank[group][layer]
        max_rank = max((ranks[s] for s in self.slots), default=0)
        if max_rank == 0:
            return  # no adapter of this batch targets this group in this layer
        s = lora_shrink(x, w.a[group][layer], w.ranks[group][layer], self.tiles, self.block_m, max_rank)
        lora_expand(s, w.b[group][layer], w.ranks[group][layer], self.tiles, w.col_tiles[group], out,
                    self.block_m, w.BLOCK_N, w.epilogue(group, layer) if self.epilogue else None)
