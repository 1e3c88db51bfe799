"""The torch LoRA backend: a few batched ops per layer and group, not per adapter.

`LoRABatch` runs a shrink, an expand and an add per adapter segment, per
layer and group. A decode step with 32 adapters is then ~11,500 tiny torch calls on
SmolLM2, pure dispatch overhead. Here the short segments of a step (every decode row,
short prefill chunks) are grouped by slot into one padded batch [E slots, P rows]:

    s     = bmm(x rows [E, P, in], Aᵀ [E, in, R])     shrink, R = the largest active rank
    out  += bmm(s [E, P, R], Bᵀ [E, R, out])          expand (scale folded, block-diagonal)

so the op count per layer and group does not grow with the number of adapters. Long
segments keep the per-segment matmuls, which are efficient there. On the "cpu" backend
the C kernel (kernels/cpu/lora.py) takes every segment instead, one call per layer and
group with no oneDNN primitive to build for each new segment length (~1 ms each: prefill
chunks rarely repeat one), except where oneDNN measured clearly faster on long bf16
segments (kernels/cpu/lora_choice.py, per adapter rank; AMX): their rows up to a
multiple of 64 run through `LoRABatch` here, one primitive per multiple.

The weights live in `SlotStacks`: per group one tensor over layers and slots, rank padded
with zeros to the largest loaded rank (zeros keep it exact: padded rank columns of `s` are
0 and meet zero rows of B). A step's slots are read as a view of a slot range when they
fill most of it, else gathered once and cached until the active slots change.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import LoRABackend, LoRAHook
from .epilogue import EpilogueBatch, apply_epilogue
from .packing import PackedGroup
from .stacks import SlotStacks

# Segments up to this many rows join the grouped batch; longer ones run per segment,
# where one [rows, in] x [in, r] matmul already amortises the call overhead.
GROUPED_MAX_ROWS = 16
# Read the weights as a view of slots lo..hi when the active slots are at least this
# share of that range: cheaper than copying them out (and no cache to keep).
RANGE_MIN_FILL = 0.5


class LoRABatch:
    """One step's segments, a shrink and an expand per segment, then the adapter's
    epilogue (epilogue.py): the reference of every LoRA backend, and the torch path for
    long segments (`epilogue=False`: the caller applies the epilogues of the whole step)."""

    def __init__(self, slots: list[list[dict[str, PackedGroup]] | None], segments: list[tuple[int, int, int]],
                 epilogue: bool = True):
        self.slots = slots
        self.segments = segments  # (start row, end row, slot), slot >= 0 only
        self.epilogue = epilogue

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        for start, end, slot in self.segments:
            packed = self.slots[slot][layer].get(group)
            if packed is None:
                continue
            s = x[start:end] @ packed.a.T  # shrink: [rows, sum of ranks]
            # One block-diagonal expand for q/k/v (gate/up), added in place: the zero blocks
            # at most triple a LoRA expand (under 1% of the base projections' work even for
            # a 1024-token chunk), while each extra call costs tens of microseconds.
            out[start:end].addmm_(s, packed.b_fused.T)
            if self.epilogue and (packed.scale is not None or packed.shift is not None):
                apply_epilogue(out[start:end], packed.scale, packed.shift)


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

    def __init__(self, stacks: SlotStacks, slots: list, segments: list[tuple[int, int, int]]) -> None:
        self.stacks = stacks
        self.segments = segments  # (start row, end row, slot), slot >= 0 only
        short = [s for s in segments if s[1] - s[0] <= GROUPED_MAX_ROWS]
        long = [s for s in segments if s[1] - s[0] > GROUPED_MAX_ROWS]
        self.long = LoRABatch(slots, long, epilogue=False) if long else None
        self.plan = _plan(short, stacks.dtype, stacks.device) if short else None
        self.epilogue = EpilogueBatch.of(stacks.epilogues, segments)
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
        if self.plan is not None:
            self._grouped(layer, group, x, out)
        if self.epilogue is not None:
            self.epilogue.apply(layer, group, out)

    def _grouped(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
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


class TorchLoRABackend(LoRABackend):
    """Grouped bmm for short segments, per-segment matmuls for long ones. The stacks are
    made on the first load, so an engine that never meets an adapter allocates nothing."""

    def __init__(self, num_slots: int, num_layers: int, in_sizes: dict[str, int], out_sizes: dict[str, int],
                 max_rank: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_slots, self.num_layers, self.in_sizes, self.out_sizes = num_slots, num_layers, in_sizes, out_sizes
        self.dtype, self.device = dtype, torch.device(device)
        self.packed: list[list[dict[str, PackedGroup]] | None] = [None] * num_slots
        self._stacks: SlotStacks | None = None

    @property
    def stacks(self) -> SlotStacks:
        if self._stacks is None:
            self._stacks = SlotStacks(self.num_slots, self.num_layers, self.in_sizes, self.out_sizes,
                                      self.dtype, self.device, pairs=self.rank_pairs())
        return self._stacks

    def rank_pairs(self) -> bool:
        """Whether B^T is stacked in rank pairs (SlotStacks `pairs`): a kernel's layout."""
        return False

    def set_slot(self, slot: int, packed: list[dict[str, PackedGroup]]) -> None:
        if slot >= len(self.packed):
            self.packed.extend([None] * (slot + 1 - len(self.packed)))
        self.packed[slot] = packed
        self.stacks.set_slot(slot, packed)

    def batch(self, segments: list[tuple[int, int, int]]) -> LoRAHook:
        return GroupedLoRABatch(self.stacks, self.packed, segments)
