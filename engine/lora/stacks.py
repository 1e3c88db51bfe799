"""Every device slot's adapter weights stacked per group, for the grouped torch path and
the C kernel (kernels/cpu/lora.c).

Rank is padded with zeros to the largest loaded rank (zeros keep it exact: padded rank
columns of the shrink are 0 and meet zero rows of B). A step's slots are read as a view
of a slot range when they fill most of it, else gathered once and cached until the
active slots change. Rows grow by doubling when an adapter lands past the last one:
a rare copy, never a step's work.
"""
from __future__ import annotations

import torch

from .epilogue import EpilogueStacks
from .packing import GROUPS, PackedGroup


def rank_pairs(bt: torch.Tensor) -> torch.Tensor:
    """Bᵀ [r, out] -> [r + r % 2, out] holding [ceil(r/2), out, 2]: ranks 2p and 2p+1 of
    each column side by side (the second zero past r), the C kernel's bf16 layout."""
    r, w = bt.shape
    out = bt.new_zeros(r + (r & 1), w)
    pairs = out.view(-1, w, 2)
    pairs[:, :, 0] = bt[0::2]
    pairs[:r // 2, :, 1] = bt[1::2]
    return out


class SlotStacks:
    """Every device slot's adapter weights per group, stacked for `bmm`.

    a[g]: [layers, slots, RA, in], the group's modules' A one after another, module m's
    rows at offset[g][m], padded to rank[g][m] (the largest rank any loaded slot has for
    it). b[g][m]: [layers, slots, rank[g][m], out_m], (B·scale)ᵀ per module: expanding per
    module reads half the bytes of a block-diagonal B, and decode steps are memory bound;
    transposed, each rank's row is contiguous for bmm. With `pairs` (the C kernel's bf16
    layout, kernels/cpu/lora.c) each slot's [r, out_m] block holds instead ranks two by two,
    [r/2, out_m, 2]: ranks 2p and 2p+1 of a column side by side, widened two at a time;
    rank is then allocated even (the odd one out's partner stays zero).
    Missing modules and groups are zeros. `epilogues`: DoRA's and lora_bias's per-feature
    maps (epilogue.py), allocated at the first adapter that has one.
    """

    def __init__(self, num_slots: int, num_layers: int, in_sizes: dict[str, int],
                 out_sizes: dict[str, int], dtype: torch.dtype, device: torch.device, pairs: bool = False) -> None:
        self.pairs = pairs
        self.num_slots, self.num_layers, self.dtype, self.device = num_slots, num_layers, dtype, device
        self.in_sizes, self.out_sizes = in_sizes, out_sizes
        self.cols = {g: [sum(out_sizes[m] for m in mods[:k]) for k in range(len(mods))] for g, mods in GROUPS.items()}
        self.rank = {g: [0] * len(mods) for g, mods in GROUPS.items()}
        self.a = {g: self._a(g) for g in GROUPS}
        self.b = {g: [self._b(g, k) for k in range(len(mods))] for g, mods in GROUPS.items()}
        # Host copy, [group][layer][slot] -> per-module ranks: per-step sizing without a sync.
        self.ranks = {g: [[(0,) * len(mods)] * num_slots for _ in range(num_layers)] for g, mods in GROUPS.items()}
        self.generation = 0  # bumped on every load: invalidates gathered copies
        # For the C kernel (kernels/cpu/lora.py): ranks as a tensor, and per group the
        # modules' layout, rebuilt when a load changed it.
        self.ranks_t = {g: torch.zeros(num_layers, num_slots, len(mods), dtype=torch.int32) for g, mods in GROUPS.items()}
        self._mods: dict[str, tuple[int, torch.Tensor]] = {}
        self._gathered_key: tuple | None = None
        self._gathered: dict[tuple[int, str], tuple] = {}
        widths = {g: sum(out_sizes[m] for m in mods) for g, mods in GROUPS.items()}
        self.epilogues = EpilogueStacks(num_slots, num_layers, widths, device)

    def ensure_rows(self, n: int) -> None:
        """At least `n` slots; growing doubles them, keeping every slot's weights."""
        if n <= self.num_slots:
            return
        old = self.num_slots
        self.num_slots = max(n, 2 * old)
        self.generation += 1
        self.epilogues.ensure_rows(self.num_slots)
        for g, mods in GROUPS.items():
            a, self.a[g] = self.a[g], self._a(g)
            self.a[g][:, :old] = a
            for k in range(len(mods)):
                b, self.b[g][k] = self.b[g][k], self._b(g, k)
                self.b[g][k][:, :old] = b
            for per_layer in self.ranks[g]:
                per_layer.extend([(0,) * len(mods)] * (self.num_slots - old))
            t, self.ranks_t[g] = self.ranks_t[g], torch.zeros(self.num_layers, self.num_slots, len(mods),
                                                              dtype=torch.int32)
            self.ranks_t[g][:, :old] = t

    def offset(self, g: str, k: int) -> int:
        return sum(self.rank[g][:k])

    def _a(self, g: str) -> torch.Tensor:
        shape = (self.num_layers, self.num_slots, sum(self.rank[g]), self.in_sizes[g])
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _b(self, g: str, k: int) -> torch.Tensor:
        shape = (self.num_layers, self.num_slots, self._span(self.rank[g][k]), self.out_sizes[GROUPS[g][k]])
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _grow(self, g: str, need: list[int]) -> None:
        # Rare (a higher-rank adapter arrives): reallocate with the wider ranks, keep the rest.
        old_rank, old_a = self.rank[g], self.a[g]
        old_offsets = [self.offset(g, k) for k in range(len(need))]
        self.rank[g] = [max(o, n) for o, n in zip(old_rank, need)]
        self.a[g] = self._a(g)
        for k, r in enumerate(old_rank):
            self.a[g][:, :, self.offset(g, k):self.offset(g, k) + r] = old_a[:, :, old_offsets[k]:old_offsets[k] + r]
            # A slot's first ranks are a prefix of its block in either layout.
            old_b, self.b[g][k] = self.b[g][k], self._b(g, k)
            self.b[g][k][:, :, :old_b.shape[2]] = old_b

    @torch.no_grad()
    def set_slot(self, slot: int, packed: list[dict[str, PackedGroup]]) -> None:
        """Copy one adapter (as `pack_adapter` made it) into `slot`, replacing what was there."""
        self.ensure_rows(slot + 1)
        self.generation += 1
        self.epilogues.set_slot(slot, packed)
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
                        self._set_bt(self.b[g][k][layer, slot], b.T)

    def _set_bt(self, dst: torch.Tensor, bt: torch.Tensor) -> None:
        """One slot's Bᵀ [r, out] into its (zeroed) block `dst` [rank, out]."""
        r = bt.shape[0]
        dst[:self._span(r)] = rank_pairs(bt) if self.pairs else bt

    def _span(self, r: int) -> int:
        """How many of a block's [rank, out] rows hold its first r ranks."""
        return r + (r & 1) if self.pairs else r

    def _rows(self, bt: torch.Tensor, r: int) -> torch.Tensor:
        """The first `_span(r)` rows of [E] blocks -> their r ranks rank-major, [E, r, out]."""
        if not self.pairs:
            return bt
        e, span, w = bt.shape
        return bt.reshape(e, span // 2, w, 2).transpose(2, 3).reshape(e, span, w)[:, :r]

    def _module_parts(self, g: str, p: PackedGroup | None) -> list[tuple[int, torch.Tensor | None, torch.Tensor | None]]:
        """Per module of group g: (rank, A [r, in], B·scale [out, r]); rank 0 when absent."""
        parts: list[tuple[int, torch.Tensor | None, torch.Tensor | None]] = [(0, None, None)] * len(GROUPS[g])
        for col, _width, r0, r, b in (p.parts if p is not None else []):
            parts[self.cols[g].index(col)] = (r, p.a[r0:r0 + r], b)
        return parts

    def c_modules(self, g: str) -> torch.Tensor:
        """int64 [modules, 6]: A row offset, allocated rank, output column, out width, B^T
        address, B^T layer stride (lora.c's `mods`); allocated rank counts B^T's (even in pairs)."""
        hit = self._mods.get(g)
        if hit is None or hit[0] != self.generation:
            rows = [[self.offset(g, k), self.b[g][k].shape[2], self.cols[g][k], self.out_sizes[m],
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
            bs = [self._rows(self.b[g][k][layer, lo:hi, :self._span(r)], r) if r else None for k, r in enumerate(ranks)]
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
            bs = [self._rows(self.b[g][k][layer, :, :self._span(r)].index_select(0, idx), r) if r else None for k, r in enumerate(ranks)]
            hit = self._gathered[(layer, g)] = (ranks, a, bs)
        return hit[1], hit[2]
