"""Which bf16 linear serves how many rows on this CPU: measured once per process.

A few kernels can serve a bf16 linear layer: the C kernel (dpbf16.c with AVX512-BF16,
else gemm.c), which streams the few rows of a small decode step faster than anything
else, and oneDNN, either on the packed bf16 weight (engine/kernels/torch/linear.py
`PackedLinear`) or on the weight widened to fp32 (`WideLinear`). Which one wins depends
on the CPU, not on the instruction flags alone: on an EPYC oneDNN never clearly beats the
C kernel; on a Xeon with AMX its bf16 tile instructions ran 5-10x the C kernel's GFLOP/s
from 16 rows up (a decode step of 64 rows had spent 55% of its time in projections at a
tenth of what the CPU could do); on a Xeon with AVX-512 but no bf16 instructions oneDNN's
bf16 matmul is emulated (~60 GFLOP/s) while its fp32 matmul on the widened weight ran
1.5-2.3x the C kernel from 32 rows up. Everywhere the C kernel still streamed 1-8 rows
fastest. So the choice is measured, once per process and thread count: the fastest of
the oneDNN kernels at the most rows measured, then it against the C kernel on a mid-size
projection at a few row counts; a layer whose batch crosses the measured row count
switches to it (holding both kernels' copies of its weight).
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

log = logging.getLogger(__name__)

Make = Callable[[torch.Tensor, "torch.Tensor | None"], nn.Module]  # make(weight, bias) -> linear layer

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


def interleaved_best(runs: dict, reps: int) -> dict:
    """key -> the fastest of `reps` timed calls of runs[key](), after one untimed call
    each. Each round times every run in turn, so a burst of other work on the machine
    slows one sample of many runs rather than every sample of one (which would move a
    crossover)."""
    for run in runs.values():
        run()
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(reps):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            best[key] = min(best[key], time.perf_counter() - start)
    return best


def measure(few: Make, many: Make, rows: tuple[int, ...] = ROWS, reps: int = 4) -> dict[int, tuple[float, float]]:
    """rows -> (`few` seconds, `many` seconds) for COPIES calls on SHAPE."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(*SHAPE, generator=gen).bfloat16() for _ in range(COPIES)]
    layers = [[few(w, None) for w in weights], [many(w, None) for w in weights]]
    xs = {n: torch.randn(n, SHAPE[1], generator=gen).bfloat16() for n in rows}
    with torch.inference_mode():
        best = interleaved_best({(n, i): _calls(layers[i], x) for n, x in xs.items() for i in (0, 1)}, reps)
    return {n: (best[n, 0], best[n, 1]) for n in rows}


def fastest(candidates: Sequence[Make], rows: int = ROWS[-1], reps: int = 4) -> Make:
    """The candidate taking the least time for COPIES calls of `rows` rows on SHAPE."""
    if len(candidates) == 1:
        return candidates[0]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(*SHAPE, generator=gen).bfloat16() for _ in range(COPIES)]
    x = torch.randn(rows, SHAPE[1], generator=gen).bfloat16()
    with torch.inference_mode():
        times = interleaved_best({make: _calls([make(w, None) for w in weights], x) for make in candidates}, reps)
    return min(times, key=times.__getitem__)


@dataclass(frozen=True)
class LinearChoice:
    """`few` serves fewer than `from_rows` rows, `many` from there (None: `few` always)."""

    few: Make
    many: Make
    from_rows: int | None

    def make(self) -> Make:
        """make(weight, bias) for the bf16 linears."""
        if self.from_rows is None:
            return self.few
        if self.from_rows <= 1:
            return self.many
        return partial(SplitLinear, few=self.few, many=self.many, from_rows=self.from_rows)


@functools.cache
def _choose(threads: int, few: Make, many: tuple[Make, ...]) -> LinearChoice:
    best = fastest(many)
    times = measure(few, best)
    start = crossover(times)
    log.info("bf16 linears with %d threads: %s (%s / %s ms by rows: %s)", threads,
             _name(few) if start is None else f"{_name(best)} from {start} rows, {_name(few)} below",
             _name(few), _name(best), ", ".join(f"{n}: {1e3 * c:.2f}/{1e3 * d:.2f}" for n, (c, d) in times.items()))
    return LinearChoice(few, best, start)


def _name(make: Make) -> str:
    return getattr(make, "__name__", repr(make))


def choose(few: Make, many: Sequence[Make]) -> LinearChoice:
    """Which of the C kernel `few` and the oneDNN kernels `many` serves each row count
    here, for torch's current thread count (measured once per process and thread count;
    ~0.5 s on 2 cores). Pass only kernels this CPU can run."""
    assert many, "no oneDNN kernel to choose from: use `few`"
    return _choose(torch.get_num_threads(), few, tuple(many))


class SplitLinear(nn.Module):
    """`y = x W^T + b` in bf16: `few(W, b)` below `from_rows` rows, `many(W, b)` from
    there (inference only; both kernels' copies of W)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, few: Make, many: Make,
                 from_rows: int) -> None:
        super().__init__()
        assert from_rows > 1, from_rows
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.from_rows = from_rows
        self.few, self.many = few(weight, bias), many(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        return (self.many if rows >= self.from_rows else self.few)(x)
