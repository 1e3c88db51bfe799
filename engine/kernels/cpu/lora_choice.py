"""Which LoRA segments oneDNN serves on this CPU: measured once per process.

Two paths can compute a segment's LoRA delta on the "cpu" backend: the C kernel
(lora.c), which serves decode rows and short segments fastest and builds nothing per
segment length, and the per-segment torch loop (`lora.torch_backend.LoRABatch`), whose
bf16 shrink and expand run on oneDNN. On a Xeon with AMX oneDNN ran long prefill
segments 1.4-5x faster than the C kernel; on an EPYC the C kernel was the faster one at
every length. So the choice is measured, as linear_choice.py measures the base
projections': one segment of an adapter on a small model's layer through both paths at a
few row counts (multiples of lora.BUCKET, the lengths the torch path is given), once per
process and thread count (~0.3-0.4 s on 2 Xeon cores), and segments from the crossover
on give their bucketed rows to oneDNN. The crossover is measured per rank, as the rank
moves it most: on that Xeon oneDNN led by 1.2x from 512 rows at rank 8, from 256 at
rank 16 and from 64 at ranks 32 and 64 (the C kernel's work grows with the rank faster
than oneDNN's).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import SimpleNamespace

import torch

from ...lora.packing import GROUPS, pack_adapter
from ...lora.stacks import SlotStacks
from ...lora.torch_backend import LoRABatch
from ..torch.linear import packing_supported
from .linear_choice import crossover, interleaved_best
from .lora import BUCKET, CLoRABatch

log = logging.getLogger(__name__)

# A small model's layer (SmolLM2-135M: hidden 576, k/v 192, MLP 1536), the adapter on all
# seven projections. The whole layer, not one group: a group's shape moves the crossover
# (on the Xeon at rank 16, gate_up alone ran 1.5-1.8x faster on oneDNN from 64 rows, the
# layer 1.2x at 64, 1.0x at 128 and 1.5-2.5x from 256).
HIDDEN, KV, INTER = 576, 192, 1536
OUT = {"q_proj": HIDDEN, "k_proj": KV, "v_proj": KV, "o_proj": HIDDEN, "gate_proj": INTER, "up_proj": INTER,
       "down_proj": HIDDEN}
GROUP_IN = {"qkv": HIDDEN, "o": HIDDEN, "gate_up": HIDDEN, "down": INTER}
ROWS = (64, 128, 256, 512, 1024)
RANKS = (8, 16, 32)  # a rank between two of these takes the lower one's crossover
LAYERS = 2  # layers taken in turn, so each call reads its adapter's weights as a step does


def _adapter(rank: int) -> tuple[SlotStacks, list]:
    """One slot of a rank-`rank` adapter over LAYERS layers, bf16: the C kernel's stacks
    and the torch path's `packed` list."""
    gen = torch.Generator().manual_seed(0)
    in_of = {m: GROUP_IN[g] for g, mods in GROUPS.items() for m in mods}
    weights = {(layer, m): SimpleNamespace(a=torch.randn(rank, in_of[m], generator=gen) / in_of[m] ** 0.5,
                                           b=torch.randn(out, rank, generator=gen) / rank ** 0.5,
                                           scale=2.0, rank=rank)
               for layer in range(LAYERS) for m, out in OUT.items()}
    cpu = torch.device("cpu")
    packed = pack_adapter(SimpleNamespace(weights=weights), OUT, LAYERS, torch.bfloat16, cpu)
    stacks = SlotStacks(1, LAYERS, GROUP_IN, OUT, torch.bfloat16, cpu, pairs=True)
    stacks.set_slot(0, packed)
    return stacks, [packed]


def _step(batch, x: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for layer in range(LAYERS):
            for g in GROUPS:
                batch.apply(layer, g, x[g], out[g])
    return run


def measure(rank: int, rows: tuple[int, ...] = ROWS, reps: int = 3) -> dict[int, tuple[float, float]]:
    """rows -> (C kernel seconds, torch/oneDNN seconds) for one segment of that many rows
    of a rank-`rank` adapter through LAYERS layers (~0.1 s for rank 16 on 2 Xeon cores)."""
    assert all(n % BUCKET == 0 for n in rows), rows
    stacks, packed = _adapter(rank)
    gen = torch.Generator().manual_seed(1)
    runs = {}
    with torch.inference_mode():
        for n in rows:
            x = {g: torch.randn(n, k, generator=gen).bfloat16() for g, k in GROUP_IN.items()}
            out = {g: torch.zeros(n, sum(OUT[m] for m in mods), dtype=torch.bfloat16) for g, mods in GROUPS.items()}
            segments = [(0, n, 0)]
            runs[n, 0] = _step(CLoRABatch(stacks, segments), x, out)
            runs[n, 1] = _step(LoRABatch(packed, segments), x, out)
        best = interleaved_best(runs, reps)
    return {n: (best[n, 0], best[n, 1]) for n in rows}


class Crossovers(dict):
    """Measured rank -> the fewest rows from which oneDNN is MARGIN times faster (None:
    never)."""

    def rows_for(self, rank: int) -> int | None:
        """The crossover for an adapter of `rank` (its largest module's): that of the
        largest measured rank at or below it (the smallest measured below them all), as a
        higher rank only moves the work further towards oneDNN."""
        below = [r for r in self if r <= rank]
        return self[max(below) if below else min(self)]


@functools.cache
def _crossovers(threads: int) -> Crossovers:
    found = Crossovers()
    for rank in RANKS:
        times = measure(rank)
        found[rank] = crossover(times)
        log.info("bf16 LoRA segments of rank %d with %d threads: %s (C / oneDNN ms by rows: %s)", rank, threads,
                 "the C kernel" if found[rank] is None else
                 f"oneDNN from {found[rank]} rows (multiples of {BUCKET}), the C kernel below and for the rest",
                 ", ".join(f"{n}: {1e3 * c:.2f}/{1e3 * d:.2f}" for n, (c, d) in times.items()))
    return found


def crossovers(dtype: torch.dtype) -> Crossovers | None:
    """Rank -> the segment length from which the torch path (oneDNN) serves a segment's
    bucketed rows here, for torch's current thread count; None (the C kernel only) where
    oneDNN never measured faster, for fp32 (the oracle's dtype) and where oneDNN has no
    native bf16 path."""
    if dtype != torch.bfloat16 or not packing_supported(torch.device("cpu"), dtype):
        return None
    found = _crossovers(torch.get_num_threads())
    return found if any(rows is not None for rows in found.values()) else None
