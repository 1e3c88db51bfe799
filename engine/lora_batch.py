"""Grouped multi-LoRA on the torch path: a few batched ops per layer and group, not per adapter.

`LoRABatch` (engine/lora.py) runs a shrink, an expand and an add per adapter segment, per
layer and group. A decode step with 32 adapters is then ~11,500 tiny torch calls on
SmolLM2, pure dispatch overhead. Here the short segments of a step (every decode row,
short prefill chunks) are grouped by slot into one padded batch [E slots, P rows]:

    s     = bmm(x rows [E, P, in], Aᵀ [E, in, R])     shrink, R = the largest active rank
    out  += bmm(s [E, P, R], Bᵀ [E, R, out])          expand (scale folded, block-diagonal)

so the op count per layer and group does not grow with the number of adapters. Long
segments keep the per-segment matmuls, which are efficient there. On the "cpu" backend
every segment, long ones included, goes to the C kernel (kernels/cpu_lora.c) instead:
one call per layer and group, and no oneDNN primitive to build for each new segment
length (~1 ms each: prefill chunks rarely repeat one).

The weights live in `SlotStacks`: per group one tensor over layers and slots, rank padded
with zeros to the largest loaded rank (zeros keep it exact: padded rank columns of `s` are
0 and meet zero rows of B). A step's slots are read as a view of a slot range when they
fill most of it, else gathered once and cached until the active slots change.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import cpu_lora
from .lora import GROUPS, LoRABatch, PackedGroup

# On the torch path, segments up to this many rows join the grouped batch; longer ones
# run per segment, where one [rows, in] x [in, r] matmul already amortises the call overhead.
GROUPED_MAX_ROWS = 16
# Read the weights as a view of slots lo..hi when the active slots are at least this
# share of that range: cheaper than copying them out (and no cache to keep).
RANGE_MIN_FILL = 0.5


class SlotStacks:
    """Every device slot's adapter weights per group, stacked for `bmm`.

    a[g]: [layers, slots, RA, in], the group's modules' A one after another, module m's
    rows at offset[g][m], padded to rank[g][m] (the largest rank any loaded slot has for
    it). b[g][m]: [layers, slots, rank[g][m], out_m], (B·scale)ᵀ per module: expanding per
    module reads half the bytes of a block-diagonal B, and decode steps are memory bound;
    transposed, each rank's row is contiguous for bmm and for the C kernel (cpu_lora.c).
    Missing modules and groups are zeros.
    """

    def __init__(self, num_slots: int, num_layers: int, in_sizes: dict[str, int],
                 out_sizes: dict[str, int], dtype: torch.dtype, device: torch.device) -> None:
        self.num_slots, self.num_layers, self.dtype, self.device = num_slots, num_layers, dtype, device
        self.in_sizes, self.out_sizes = in_sizes, out_sizes
        self.cols = {g: [sum(out_sizes[m] for m in mods[:k]) for k in range(len(mods))] for g, mods in GROUPS.items()}
        self.rank = {g: [0] * len(mods) for g, mods in GROUPS.items()}
        self.a = {g: self._a(g) for g in GROUPS}
        self.b = {g: [self._b(g, k) for k in range(len(mods))] for g, mods in GROUPS.items()}
        # Host copy, [group][layer][slot] -> per-module ranks: per-step sizing without a sync.
        self.ranks = {g: [[(0,) * len(mods)] * num_slots for _ in range(num_layers)] for g, mods in GROUPS.items()}
        self.generation = 0  # bumped on every load: invalidates gathered copies
        # For the C kernel (kernels/cpu_lora.py): ranks as a tensor, and per group the
        # modules' layout, rebuilt when a load changed it.
        self.ranks_t = {g: torch.zeros(num_layers, num_slots, len(mods), dtype=torch.int32) for g, mods in GROUPS.items()}
        self._mods: dict[str, tuple[int, torch.Tensor]] = {}
        self._gathered_key: tuple | None = None
        self._gathered: dict[tuple[int, str], tuple] = {}

    def offset(self, g: str, k: int) -> int:
        return sum(self.rank[g][:k])

    def _a(self, g: str) -> torch.Tensor:
        shape = (self.num_layers, self.num_slots, sum(self.rank[g]), self.in_sizes[g])
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _b(self, g: str, k: int) -> torch.Tensor:
        shape = (self.num_layers, self.num_slots, self.rank[g][k], self.out_sizes[GROUPS[g][k]])
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _grow(self, g: str, need: list[int]) -> None:
        # Rare (a higher-rank adapter arrives): reallocate with the wider ranks, keep the rest.
        old_rank, old_a = self.rank[g], self.a[g]
        old_offsets = [self.offset(g, k) for k in range(len(need))]
        self.rank[g] = [max(o, n) for o, n in zip(old_rank, need)]
        self.a[g] = self._a(g)
        for k, r in enumerate(old_rank):
            self.a[g][:, :, self.offset(g, k):self.offset(g, k) + r] = old_a[:, :, old_offsets[k]:old_offsets[k] + r]
            old_b, self.b[g][k] = self.b[g][k], self._b(g, k)
            self.b[g][k][:, :, :r] = old_b

    @torch.no_grad()
    def set_slot(self, slot: int, packed: list[dict[str, PackedGroup]]) -> None:
        """Copy one adapter (as `pack_adapter` made it) into `slot`, replacing what was there."""
        self.generation += 1
        for g in GROUPS:
            per_layer = [self._module_parts(g, layer.get(g)) for layer in packed]
            need = [max((parts[k][0] for parts in per_layer), default=0) for k in range(len(GROUPS[g]))]
            if any(n > r for n, r in zip(need, self.rank[g])):
                self._grow(g, need)
            self.a[g][:, slot].zero_()
            for b in self.b[g]:
                b[:, slot].zero_()
            for layer, parts in enumerate(per_layer):
                self.ranks[g][layer][slot] = tuple(r for r, _, _ in parts)
                self.ranks_t[g][layer, slot] = torch.tensor([r for r, _, _ in parts], dtype=torch.int32)
                for k, (r, a, b) in enumerate(parts):
                    if r:
                        off = self.offset(g, k)
                        self.a[g][layer, slot, off:off + r] = a
                        self.b[g][k][layer, slot, :r] = b.T

    def _module_parts(self, g: str, p: PackedGroup | None) -> list[tuple[int, torch.Tensor | None, torch.Tensor | None]]:
        """Per module of group g: (rank, A [r, in], B·scale [out, r]); rank 0 when absent."""
        parts: list[tuple[int, torch.Tensor | None, torch.Tensor | None]] = [(0, None, None)] * len(GROUPS[g])
        for col, _width, r0, r, b in (p.parts if p is not None else []):
            parts[self.cols[g].index(col)] = (r, p.a[r0:r0 + r], b)
        return parts

    def c_modules(self, g: str) -> torch.Tensor:
        """int64 [modules, 6]: A row offset, allocated rank, output column, out width, B^T
        address, B^T layer stride (cpu_lora.c's `mods`)."""
        hit = self._mods.get(g)
        if hit is None or hit[0] != self.generation:
            rows = [[self.offset(g, k), self.rank[g][k], self.cols[g][k], self.out_sizes[m],
                     self.b[g][k].data_ptr(), self.b[g][k].stride(0)] for k, m in enumerate(GROUPS[g])]
            hit = self._mods[g] = (self.generation, torch.tensor(rows, dtype=torch.int64))
        return hit[1]

    def weights(self, layer: int, g: str, slots: tuple[int, ...], ranks: tuple[int, ...]):
        """Aᵀ [E, in, RA] and per module Bᵀ [E, r, out_m] (r = `ranks`[k], 0: None) for
        `slots` (sorted, distinct); RA stops at the last module with a rank."""
        last = max(k for k, r in enumerate(ranks) if r)
        ra = self.offset(g, last) + ranks[last]
        lo, hi = slots[0], slots[-1] + 1
        if hi - lo == len(slots):  # a slot range: views, no copy
            a = self.a[g][layer, lo:hi, :ra]
            bs = [self.b[g][k][layer, lo:hi, :r] if r else None for k, r in enumerate(ranks)]
        else:
            a, bs = self._gather(layer, g, slots, ra, ranks)
        return a.transpose(1, 2), bs

    def _gather(self, layer: int, g: str, slots: tuple[int, ...], ra: int, ranks: tuple[int, ...]):
        # Decode steps repeat the same slots for many steps: copy once, reuse until they change.
        key = (slots, self.generation)
        if key != self._gathered_key:
            self._gathered_key, self._gathered = key, {}
        hit = self._gathered.get((layer, g))
        if hit is None or hit[0] != ranks:
            idx = torch.tensor(slots, device=self.device)
            a = self.a[g][layer, :, :ra].index_select(0, idx)
            bs = [self.b[g][k][layer, :, :r].index_select(0, idx) if r else None for k, r in enumerate(ranks)]
            hit = self._gathered[(layer, g)] = (ranks, a, bs)
        return hit[1], hit[2]


@dataclass
class _Plan:
    """The grouped rows of one step: E slots x P rows, padding marked in `mask`."""

    slots: tuple[int, ...]  # entry -> slot, sorted; with RANGE_MIN_FILL may include idle slots
    rows: int  # P
    contiguous: tuple[int, int] | None  # (first row, end row) when entries tile it exactly
    index: torch.Tensor | None  # [E*P] batch row per entry row (padding: any grouped row)
    mask: torch.Tensor | None  # [E, P, 1] 1 for real rows, None when there is no padding


def _plan(segments: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device) -> _Plan:
    rows_of: dict[int, list[int]] = {}
    for start, end, slot in segments:
        rows_of.setdefault(slot, []).extend(range(start, end))
    active = tuple(sorted(rows_of))
    lo, hi = active[0], active[-1] + 1
    slots = tuple(range(lo, hi)) if len(active) >= RANGE_MIN_FILL * (hi - lo) else active
    p = max(len(r) for r in rows_of.values())
    flat = [row for s in slots for row in rows_of.get(s, [])]
    if len(flat) == len(slots) * p and flat == list(range(flat[0], flat[0] + len(flat))):
        return _Plan(slots, p, (flat[0], flat[0] + len(flat)), None, None)
    pad = flat[0]  # padded rows read a real row; their shrink is zeroed, so they add exactly 0
    index, mask = [], []
    for s in slots:
        r = rows_of.get(s, [])
        index += r + [pad] * (p - len(r))
        mask += [1] * len(r) + [0] * (p - len(r))
    index_t = torch.tensor(index, device=device)
    mask_t = None if all(mask) else torch.tensor(mask, dtype=dtype, device=device).view(len(slots), p, 1)
    return _Plan(slots, p, None, index_t, mask_t)


class GroupedLoRABatch:
    """One step's adapter segments; `apply` adds the deltas in place (as `LoRABatch.apply`)."""

    def __init__(self, stacks: SlotStacks, slots: list, segments: list[tuple[int, int, int]],
                 c_kernel: bool = False) -> None:
        """`c_kernel`: every segment through kernels/cpu_lora.c (the "cpu" backend)."""
        self.stacks = stacks
        self.segments = segments  # (start row, end row, slot), slot >= 0 only
        self.c_segments, self.long, self.plan = None, None, None
        if c_kernel:
            # The C kernel takes every segment as it is (no padding, no gather), long ones
            # cut into pieces: one call per layer and group, whatever the segments' lengths.
            self.c_segments = cpu_lora.pieces(segments)
        else:
            short = [s for s in segments if s[1] - s[0] <= GROUPED_MAX_ROWS]
            long = [s for s in segments if s[1] - s[0] > GROUPED_MAX_ROWS]
            self.long = LoRABatch(slots, long) if long else None
            self.plan = _plan(short, stacks.dtype, stacks.device) if short else None
        # Per (layer, group): each module's largest rank over the grouped slots.
        self._ranks: dict[tuple[int, str], tuple[int, ...]] = {}

    def _active_ranks(self, layer: int, g: str) -> tuple[int, ...]:
        ranks = self._ranks.get((layer, g))
        if ranks is None:
            per_slot = self.stacks.ranks[g][layer]
            ranks = self._ranks[(layer, g)] = tuple(map(max, zip(*(per_slot[s] for s in self.plan.slots))))
        return ranks

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.long is not None:
            self.long.apply(layer, group, x, out)
        if self.c_segments is not None:
            s = self.stacks
            cpu_lora.cpu_lora_segments(x, out, self.c_segments, s.a[group], s.c_modules(group), s.ranks_t[group], layer)
            return
        if self.plan is None:
            return
        ranks = self._active_ranks(layer, group)
        if not any(ranks):
            return  # no grouped adapter targets this group in this layer
        plan, stacks = self.plan, self.stacks
        a_t, b_ts = stacks.weights(layer, group, plan.slots, ranks)
        e, p = len(plan.slots), plan.rows
        contiguous = plan.contiguous is not None and out.is_contiguous()
        if plan.contiguous is not None:
            r0, r1 = plan.contiguous
            s = torch.bmm(x[r0:r1].reshape(e, p, -1), a_t)
        else:
            s = torch.bmm(x.index_select(0, plan.index).view(e, p, -1), a_t)
            if plan.mask is not None:
                s.mul_(plan.mask)  # padded rows add exactly 0
        # Expand straight into `out` when the rows are one block, else into a scratch delta.
        target = out[r0:r1].view(e, p, -1) if contiguous else out.new_zeros(e, p, out.shape[1])
        for k, b_t in enumerate(b_ts):
            if b_t is not None:
                off, col = stacks.offset(group, k), stacks.cols[group][k]
                target[..., col:col + b_t.shape[2]].baddbmm_(s[..., off:off + b_t.shape[1]], b_t)
        if plan.contiguous is None:
            out.index_add_(0, plan.index, target.view(e * p, -1))
        elif not contiguous:
            out[r0:r1] += target.view(e * p, -1)
