"""The "cpu" backend's bf16 linears keep a second copy of the weights (the oneDNN side of
a split by row count) only where the host has the memory for it."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels.cpu import amx, dpbf16, gemm, linear_choice as lc
from loraplex.engine.kernels.cpu.backend import CpuBackend, c_linear
from loraplex.engine.kernels.torch.linear import PackedLinear, WideLinear, packing_supported, widening_supported

CPU = torch.device("cpu")
GIB = 1 << 30
FEW = c_linear()
MANY = [m for m, ok in ((PackedLinear, packing_supported(CPU, torch.bfloat16)),
                        (WideLinear, widening_supported(CPU, torch.bfloat16))) if ok]
needs_c = pytest.mark.skipif(not gemm.load_library(), reason="needs the C bf16 kernel")


def _same(a, b) -> bool:
    """Two make(weight, bias) are the same kernel (a split's partial: the same split)."""
    return getattr(a, "func", a) is getattr(b, "func", b) and getattr(a, "keywords", {}) == getattr(b, "keywords", {})


def test_a_split_holds_each_kernels_copy_beyond_the_weights_one():
    # packed bf16 beside the C kernel's bf16 copy: one more; widened to fp32: two more
    assert lc.split_extra_bytes(gemm.Bf16Linear, PackedLinear, 1000) == 1000
    assert lc.split_extra_bytes(dpbf16.Dpbf16Linear, WideLinear, 1000) == 2000


@needs_c
@pytest.mark.skipif(not MANY, reason="no oneDNN bf16 linear on this CPU")
def test_without_memory_to_spare_every_row_count_runs_the_c_kernel(monkeypatch):
    # a choice that splits at 16 rows, whatever this machine measures
    monkeypatch.setattr(lc, "choose", lambda few, many: lc.LinearChoice(few, many[0], 16))
    backend = CpuBackend(CPU, torch.bfloat16)
    assert backend.linear_factory(weight_bytes=GIB, spare_bytes=None).func is lc.SplitLinear
    assert backend.linear_factory(weight_bytes=4 * GIB, spare_bytes=GIB) is FEW


@needs_c
@pytest.mark.skipif(not MANY, reason="no oneDNN bf16 linear on this CPU")
def test_with_memory_to_spare_the_measured_choice_serves():
    backend = CpuBackend(CPU, torch.bfloat16)
    want = lc.choose(FEW, MANY).make()
    assert _same(backend.linear_factory(weight_bytes=GIB, spare_bytes=2 * GIB), want)
    assert _same(backend.linear_factory(weight_bytes=GIB, spare_bytes=None), want)  # host memory unknown


@needs_c
@pytest.mark.skipif(len(MANY) < 2, reason="needs both oneDNN kernels (packed bf16 and widened)")
def test_the_choice_is_among_the_kernels_that_fit():
    # room for a packed bf16 copy (1x) but not a widened fp32 one (2x)
    make = CpuBackend(CPU, torch.bfloat16).linear_factory(weight_bytes=GIB, spare_bytes=GIB)
    assert _same(make, lc.choose(FEW, [PackedLinear]).make())


@needs_c
def test_the_c_linear_is_the_most_capable_kernel_this_cpu_runs():
    # AMX tiles over dpbf16.c (AVX-512) over the 8-lane widening GEMM: each the faster where it runs.
    want = amx.AmxLinear if amx.supported() else dpbf16.Dpbf16Linear if dpbf16.supported() else gemm.Bf16Linear
    assert c_linear() is want
    if amx.supported():  # this machine: the tiles serve the backend's linears
        assert CpuBackend(CPU, torch.bfloat16).linear_factory(weight_bytes=GIB, spare_bytes=0) is amx.AmxLinear
