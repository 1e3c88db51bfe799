"""Which bf16 linear serves how many rows on this CPU: measured once per process.

A few kernels can serve a bf16 linear layer: the C kernel (backend.c_linear: amx.c's
tiles with AMX, dpbf16.c with AVX-512, else gemm.c), which streams the few rows of a
small decode step faster than anything else, and oneDNN, either on the packed bf16
weight (engine/kernels/torch/linear.py `PackedLinear`) or on the weight widened to fp32
(`WideLinear`). Which one wins depends on the CPU, not on the instruction flags alone: on
an EPYC oneDNN never clearly beats the C kernel; on a Xeon with AMX oneDNN's tile matmul
ran 5-10x dpbf16.c from 16 rows up, and amx.c runs 1.0-1.3x oneDNN there; on a Xeon
with AVX-512 but no bf16 instructions oneDNN's bf16 matmul is emulated (~60 GFLOP/s)
while its fp32 matmul on the widened weight ran 1.5-2.3x gemm.c's 8 lanes from 32 rows
up, and dpbf16.c's 16-lane spelling for such CPUs runs 1.3-1.9x that fp32 matmul at 64
rows and level with it from 256. Everywhere the C kernel still streamed 1-8 rows
fastest. So the choice is measured, once per process and thread count: every kernel on
a mid-size projection at a few row counts, the fastest oneDNN kernel at the most rows
against the C kernel; a layer whose batch crosses the measured row count switches to it
(holding both kernels' copies of its weight).
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

from ..torch.linear import builds_state_per_shape

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


def measure(kernels: Sequence[Make], rows: tuple[int, ...] = ROWS, reps: int = 4) -> dict[int, tuple[float, ...]]:
    """rows -> each kernel's seconds (in `kernels`' order) for COPIES calls on SHAPE."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(*SHAPE, generator=gen).bfloat16() for _ in range(COPIES)]
    layers = [[make(w, None) for w in weights] for make in kernels]
    xs = {n: torch.randn(n, SHAPE[1], generator=gen).bfloat16() for n in rows}
    with torch.inference_mode():
        best = interleaved_best({(n, i): _calls(ls, x) for n, x in xs.items() for i, ls in enumerate(layers)}, reps)
    return {n: tuple(best[n, i] for i in range(len(kernels))) for n in rows}


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


def decide(few: Make, many: Sequence[Make], times: dict[int, tuple[float, ...]]) -> LinearChoice:
    """From `measure([few, *many])`: the fastest of `many` at the most rows measured,
    serving from its `crossover` with `few`."""
    top = times[max(times)][1:]
    best = min(range(len(many)), key=top.__getitem__)
    return LinearChoice(few, many[best], crossover({n: (t[0], t[1 + best]) for n, t in times.items()}))


@functools.cache
def _choose(threads: int, few: Make, many: tuple[Make, ...]) -> LinearChoice:
    times = measure((few, *many))
    choice = decide(few, many, times)
    log.info("bf16 linears with %d threads: %s (%s ms by rows: %s)", threads,
             _name(few) if choice.from_rows is None else
             f"{_name(choice.many)} from {choice.from_rows} rows, {_name(few)} below",
             " / ".join(map(_name, (few, *many))),
             ", ".join(f"{n}: " + "/".join(f"{1e3 * x:.2f}" for x in t) for n, t in times.items()))
    return choice


def _name(make: Make) -> str:
    return getattr(make, "__name__", repr(make))


def choose(few: Make, many: Sequence[Make]) -> LinearChoice:
    """Which of the C kernel `few` and the oneDNN kernels `many` serves each row count
    here, for torch's current thread count (measured once per process and thread count;
    0.5-3 s on 2 cores, the most where bf16 is emulated). Pass only kernels this CPU can run."""
    assert many, "no oneDNN kernel to choose from: use `few`"
    return _choose(torch.get_num_threads(), few, tuple(many))


def split_extra_bytes(few: Make, many: Make, weight_bytes: int) -> int:
    """Bytes a `SplitLinear` of `few` and `many` over weights of `weight_bytes` holds
    beyond one copy of them (each kernel's `weight_bytes_held` copy)."""
    held = getattr(few, "weight_bytes_held", 1) + getattr(many, "weight_bytes_held", 1)
    return int((held - 1) * weight_bytes)


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

    @property
    def per_shape_state(self) -> bool:
        return builds_state_per_shape(self.few) or builds_state_per_shape(self.many)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        return (self.many if rows >= self.from_rows else self.few)(x)
