"""The C multi-LoRA kernel (lora.c) over `lora.stacks.SlotStacks`: a step's adapter
segments, decode rows and short prefill chunks, in one call per layer and group, and no
oneDNN primitive to build for each new segment length (~1 ms each: prefill chunks rarely
repeat one).

Where oneDNN measured clearly faster on long segments (lora_choice.py: AMX on a Xeon),
a segment of at least that many bf16 rows (measured per adapter rank) has its first
multiple of BUCKET rows run through the per-segment torch loop
(`lora.torch_backend.LoRABatch`: a shrink and an expand matmul, then its epilogue) and
the rest through the C kernel with the short pieces; rounding to BUCKET keeps oneDNN to
one primitive per multiple. Elsewhere (fp32, an EPYC) every segment goes to the C kernel.

Its reference is that per-segment torch loop, which the tests compare it with.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from ...lora.packing import GROUPS, PackedGroup
from ...lora.stacks import SlotStacks
from ...lora.torch_backend import LoRABatch
from . import build

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_ARGTYPES = [_P, _L, _P, _L, _P, _P, _L, _L, _I, _I, _P, _P, _I, _P, _P, _P, _L, _I, _I]
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
MAX_ROWS = 64  # the kernel's per-piece row limit (lora.c MAX_ROWS)
# Rows per work item: long segments are cut into pieces of this size so both threads
# share a prefill chunk, while each piece still reuses the adapter's weights 32 times.
PIECE_ROWS = 32
# Rows a long segment gives the torch path come in multiples of this: a step's new
# prefill lengths then reuse oneDNN's primitive for one of a few lengths instead of
# building their own, and the C kernel takes the remainder in at most two pieces.
BUCKET = 64


def load_library() -> ctypes.CDLL | None:
    return build.load("lora.c", {f"lora_segments_{t}": _ARGTYPES for t in _SUFFIX.values()})


def pieces(segments: list[tuple[int, int, int]], rows: int = PIECE_ROWS) -> torch.Tensor:
    """(start, end, slot) segments -> int32 [pieces, 3], each at most `rows` rows."""
    assert 0 < rows <= MAX_ROWS
    out = [(s, min(s + rows, end), slot) for start, end, slot in segments for s in range(start, end, rows)]
    return torch.tensor(out, dtype=torch.int32).view(-1, 3)


def split(segments: list[tuple[int, int, int]], torch_from_rows: Callable[[int], int | None] | None
          ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """(the C kernel's segments, the torch path's): of each segment of at least
    `torch_from_rows(slot)` rows (None: none) its first multiple of BUCKET rows go to
    torch, the rest (and every shorter segment) to the C kernel; rows disjoint, in order."""
    c, onednn = [], []
    for start, end, slot in segments:
        cut, limit = start, None if torch_from_rows is None else torch_from_rows(slot)
        if limit is not None and end - start >= limit:
            cut = start + (end - start) // BUCKET * BUCKET
            if cut > start:
                onednn.append((start, cut, slot))
        if end > cut:
            c.append((cut, end, slot))
    return c, onednn


def cpu_lora_segments(x: torch.Tensor, out: torch.Tensor, segments: torch.Tensor, a: torch.Tensor,
                      mods: torch.Tensor, ranks: torch.Tensor, layer: int,
                      epilogue: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """out[rows] += LoRA delta of each piece (start, end, slot) over a group's modules.

    a: [layers, slots, RA, in] stacked A; mods: int64 [modules, 6] (A row offset, r_alloc,
    output column, out width, B^T base address, B^T layer stride); ranks: int32
    [layers, slots, modules]. bf16 B^T is in rank pairs (`SlotStacks(pairs=True)`, r_alloc
    even), fp32 B^T rank-major. `epilogue`: the layer's (flags int32 [slots], scale and
    shift fp32 [slots, group width]) of lora/epilogue.py: rows of a flagged slot then
    become out * scale + shift."""
    lib = load_library()
    assert lib is not None, "load_library() returned None: use the torch path"
    assert x.dtype == out.dtype == a.dtype and x.dtype in _SUFFIX, (x.dtype, out.dtype, a.dtype)
    assert x.stride(1) == 1 and out.stride(1) == 1 and a.is_contiguous() and a.shape[3] == x.shape[1]
    assert segments.dtype == torch.int32 and segments.dim() == 2 and segments.shape[1] == 3 and segments.is_contiguous()
    assert mods.dtype == torch.int64 and mods.shape[1] == 6 and mods.is_contiguous()
    assert ranks.dtype == torch.int32 and ranks.is_contiguous() and ranks.shape == (a.shape[0], a.shape[1], mods.shape[0])
    assert 0 <= layer < a.shape[0]
    if len(segments):
        assert segments[:, 1].max() <= min(x.shape[0], out.shape[0]) and segments[:, 0].min() >= 0
        assert 0 <= segments[:, 2].min() and segments[:, 2].max() < a.shape[1]
    epi = (0, 0, 0, 0)
    if epilogue is not None:
        flags, scale, shift = epilogue
        assert flags.dtype == torch.int32 and flags.shape == (a.shape[1],) and flags.is_contiguous()
        assert scale.dtype == shift.dtype == torch.float32 and scale.shape == shift.shape == (a.shape[1], out.shape[1])
        assert scale.stride() == shift.stride() and scale.stride(1) == 1
        epi = (flags.data_ptr(), scale.data_ptr(), shift.data_ptr(), scale.stride(0))
    fn = getattr(lib, f"lora_segments_{_SUFFIX[x.dtype]}")
    args = (x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), segments.data_ptr(), a.data_ptr(),
            a.stride(0), a.stride(1), a.shape[3], mods.shape[0], mods.data_ptr(), ranks[layer].data_ptr(), layer,
            *epi)
    build.run(fn, args, segments.shape[0])


class CLoRABatch:
    """One step's segments, cut into pieces once; `apply` is one kernel call, the
    epilogues (DoRA, lora_bias) of the rows whose adapters have one included, plus the
    torch loop over the long segments' rows `split` gives it (`torch_from_rows`, which
    needs the backend's `packed` adapters; each path applies its own rows' epilogues).

    What stays fixed over the step (pieces, stack addresses, each group's modules) is
    bound once per group, so a call only adds the layer's and the activations' addresses:
    `cpu_lora_segments`' checks on every one of a step's 120 calls cost ~1 ms on SmolLM2."""

    def __init__(self, stacks: SlotStacks, segments: list[tuple[int, int, int]],
                 packed: list[list[dict[str, PackedGroup]] | None] | None = None,
                 torch_from_rows: Callable[[int], int | None] | None = None) -> None:
        lib = load_library()
        assert lib is not None, "load_library() returned None: use the torch path"
        assert stacks.dtype in _SUFFIX and stacks.pairs == (stacks.dtype == torch.bfloat16), (stacks.dtype, stacks.pairs)
        self.stacks = stacks
        assert all(0 <= slot < stacks.num_slots for *_, slot in segments)
        c_segments, onednn = split(segments, torch_from_rows)
        assert packed is not None or not onednn, "the torch path reads the backend's packed adapters"
        self.torch = LoRABatch(packed, onednn) if onednn else None
        self.pieces = pieces(c_segments)
        self.rows = max((end for _, end, _ in segments), default=0)
        self.epilogue = any(slot in stacks.epilogues.slots for *_, slot in c_segments)
        self.fn = getattr(lib, f"lora_segments_{_SUFFIX[stacks.dtype]}")
        self.generation = stacks.generation
        self.bound: dict[str, tuple] = {}

    def _bind(self, group: str) -> tuple:
        s = self.stacks
        a, mods, ranks = s.a[group], s.c_modules(group), s.ranks_t[group]
        assert a.is_contiguous() and ranks.is_contiguous() and ranks.shape == (a.shape[0], a.shape[1], mods.shape[0])
        # mods and ranks stay referenced: the kernel reads them through their addresses.
        return (a.shape[3], sum(s.out_sizes[m] for m in GROUPS[group]), mods, ranks, ranks.data_ptr(),
                ranks.stride(0) * ranks.element_size(),
                (self.pieces.data_ptr(), a.data_ptr(), a.stride(0), a.stride(1), a.shape[3], mods.shape[0],
                 mods.data_ptr()))

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.torch is not None:
            self.torch.apply(layer, group, x, out)
        if not len(self.pieces):
            return
        s = self.stacks
        if s.generation != self.generation:  # an adapter loaded mid-step moved the stacks
            self.generation, self.bound = s.generation, {}
        bound = self.bound.get(group) or self.bound.setdefault(group, self._bind(group))
        in_dim, width, _, _, ranks_ptr, ranks_layer, fixed = bound
        assert x.dtype == out.dtype == s.dtype and x.shape[1] == in_dim and out.shape[1] >= width, (x.shape, out.shape)
        assert x.stride(1) == 1 == out.stride(1) and min(x.shape[0], out.shape[0]) >= self.rows
        assert 0 <= layer < s.num_layers
        epi = (0, 0, 0, 0)
        if self.epilogue:
            flags, scale, shift = s.epilogues.layer(group, layer)
            epi = (flags.data_ptr(), scale.data_ptr(), shift.data_ptr(), scale.stride(0))
        build.run(self.fn, (x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), *fixed,
                            ranks_ptr + layer * ranks_layer, layer, *epi), self.pieces.shape[0])
