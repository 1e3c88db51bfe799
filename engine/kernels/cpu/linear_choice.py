"""Which bf16 linear serves how many rows on this CPU: measured once per process.

On a CPU with AVX512-BF16 two kernels can serve a linear layer: the C kernel
(dpbf16.c), which streams the few rows of a small decode step faster than anything else,
and oneDNN's packed bf16 matmul (engine/kernels/torch/linear.py). Which one wins depends
on the CPU, not on the instruction flags alone: on an EPYC oneDNN never clearly beats the
C kernel, while on a Xeon with AMX its tile instructions ran 5-10x the C kernel's
GFLOP/s from 16 rows up (and the C kernel still streamed 1-4 rows 1.5-2.3x faster). A
decode step of 64 rows then spent 55% of its time in projections at a tenth of what the
CPU could do. So the choice is measured: both kernels on a mid-size projection at a few
row counts, once per process and thread count, and a layer whose batch crosses the
measured row count switches to oneDNN (holding both packed copies of its weight).
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from ..torch.linear import PackedLinear
from .dpbf16 import Dpbf16Linear

log = logging.getLogger(__name__)

SHAPE = (1536, 576)  # (out, in) of the measured projection: a small model's MLP
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
# oneDNN must be this much faster, at the crossover and at every row count above it, to
# be worth a second copy of every weight (measured noise on a shared machine: ~10%).
MARGIN = 1.2
COPIES = 8  # weights taken in turn, so each call reads its weight from beyond L2 as a step does


def crossover(times: dict[int, tuple[float, float]], margin: float = MARGIN) -> int | None:
    """The fewest rows from which oneDNN is `margin` times faster than the C kernel at
    every measured row count (times: rows -> (C seconds, oneDNN seconds)); None if it
    is not at the most rows measured."""
    start = None
    for rows in sorted(times, reverse=True):
        c, onednn = times[rows]
        if onednn * margin > c:
            break
        start = rows
    return start


def best_time(run: Callable[[], None], reps: int) -> float:
    """The fastest of `reps` timed calls of `run`, after one untimed call (oneDNN builds
    its primitive for a shape on first use)."""
    run()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _calls(layers: list[nn.Module], x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        for layer in layers:
            layer(x)
    return run


def measure(rows: tuple[int, ...] = ROWS, reps: int = 3) -> dict[int, tuple[float, float]]:
    """rows -> (C kernel seconds, oneDNN seconds) for COPIES calls on SHAPE."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(*SHAPE, generator=gen).bfloat16() for _ in range(COPIES)]
    c, onednn = [Dpbf16Linear(w, None) for w in weights], [PackedLinear(w, None) for w in weights]
    with torch.inference_mode():
        return {n: (best_time(_calls(c, x), reps), best_time(_calls(onednn, x), reps))
                for n in rows for x in (torch.randn(n, SHAPE[1], generator=gen).bfloat16(),)}


@functools.cache
def _onednn_from_rows(threads: int) -> int | None:
    times = measure()
    start = crossover(times)
    log.info("bf16 linears with %d threads: %s (C / oneDNN ms by rows: %s)", threads,
             "the C kernel" if start is None else f"oneDNN from {start} rows, the C kernel below",
             ", ".join(f"{n}: {1e3 * c:.2f}/{1e3 * d:.2f}" for n, (c, d) in times.items()))
    return start


def onednn_from_rows() -> int | None:
    """The row count from which oneDNN serves the bf16 linears here (None: never), for
    torch's current thread count. Call only where both kernels exist (dpbf16.supported()
    and torch.linear.packing_supported)."""
    return _onednn_from_rows(torch.get_num_threads())


class SplitLinear(nn.Module):
    """`y = x W^T + b` in bf16: the C kernel below `from_rows` rows, oneDNN's packed
    weight from there (inference only; two packed copies of W)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, from_rows: int) -> None:
        super().__init__()
        assert from_rows > 1, from_rows
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.from_rows = from_rows
        self.few, self.many = Dpbf16Linear(weight, bias), PackedLinear(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        return (self.many if rows >= self.from_rows else self.few)(x)


def linear_for_this_cpu() -> type[nn.Module] | partial:
    """make(weight, bias) for the bf16 linears, by `onednn_from_rows`."""
    start = onednn_from_rows()
    if start is None:
        return Dpbf16Linear
    return PackedLinear if start <= 1 else partial(SplitLinear, from_rows=start)
