"""The C bf16 GEMMs against their reference, F.linear in fp32 on the same bf16 values:
gemm.c (AVX2 and generic: widened bf16, FMA), dpbf16.c (vdpbf16ps with AVX512-BF16, and
its AVX-512F spelling, built for a target without AVX512-BF16 so that every AVX-512
machine tests it) and amx.c (AMX tiles, from amx.FROM_ROWS rows of a K that is a
multiple of 32; dpbf16.c below).

Both accumulate in fp32 and round once to bf16; only the order of the sums differs, so
results agree to a bf16 rounding step.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine.kernels.cpu import amx as cpu_amx, dpbf16 as cpu_dpbf16, gemm as cpu_gemm
from tests.engine.kernels.kernel_cases import use_build

BF16_STEP = dict(rtol=2 ** -7, atol=1e-2)
KERNELS = {
    "cpu_gemm": (cpu_gemm.pack_weight, cpu_gemm.cpu_gemm_bf16, cpu_gemm.Bf16Linear),
    "cpu_dpbf16": (cpu_dpbf16.pack_weight, cpu_dpbf16.dpbf16_linear, cpu_dpbf16.Dpbf16Linear),
    "cpu_dpbf16_avx512f": (cpu_dpbf16.pack_weight, cpu_dpbf16.dpbf16_linear, cpu_dpbf16.Dpbf16Linear),
    "cpu_amx": (cpu_dpbf16.pack_weight, cpu_amx.tiled_linear, cpu_amx.AmxLinear),
}
needs_amx = pytest.mark.skipif(not cpu_amx.supported(), reason="this CPU has no AMX (or no C compiler)")


@pytest.fixture(params=list(KERNELS))
def kernel(request, monkeypatch):
    """(pack, linear, module) of each kernel this machine can run."""
    if request.param == "cpu_gemm" and cpu_gemm.load_library() is None:
        pytest.skip("no C compiler to build the CPU kernels")
    if request.param == "cpu_dpbf16" and not cpu_dpbf16.supported():
        pytest.skip("this CPU has no AVX-512 (or no C compiler)")
    if request.param == "cpu_dpbf16_avx512f":
        use_build(monkeypatch, cpu_dpbf16, "dpbf16.c", {"gemm_dpbf16": cpu_dpbf16._ARGTYPES, "dpbf16_available": []},
                  "skylake-avx512")
        assert cpu_dpbf16.load_library().dpbf16_available() == 2  # the widening path, whatever this CPU has
    if request.param == "cpu_amx" and not cpu_amx.supported():
        pytest.skip("this CPU has no AMX (or no C compiler)")
    return KERNELS[request.param]


def _reference(x, w, b=None):
    return F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()


# Every micro-kernel row count (6 in gemm.c, 1-8 in dpbf16.c), tails, two row chunks;
# partial panels and work items of 1-3 panels; odd K; a short last group of panels
# (80 columns), which the group before it fetches ahead (dpbf16.c).
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 13, 64, 300])
@pytest.mark.parametrize("n, k", [(96, 64), (37, 40), (16, 3), (1, 129), (130, 576), (80, 72)])
def test_matches_f_linear(rows, n, k, kernel):
    pack, linear, _ = kernel
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    packed = pack(w)
    torch.testing.assert_close(linear(x, packed, n), _reference(x, w), **BF16_STEP)
    torch.testing.assert_close(linear(x, packed, n, b), _reference(x, w, b), **BF16_STEP)


def test_one_rounding_from_the_fp32_result(kernel):
    # fp32 accumulation and a single bf16 rounding: within half a bf16 step of the exact
    # value (bf16 partial sums over 576 products would drift well past it).
    pack, linear, _ = kernel
    x = torch.randn(14, 576).bfloat16()
    w = (torch.randn(960, 576) / 24).bfloat16()
    exact = F.linear(x.float(), w.float())
    err = (linear(x, pack(w), 960).float() - exact).abs()
    assert (err <= exact.abs() * 2 ** -8 + 1e-6).all()


def test_reads_rows_with_a_stride(kernel):
    # q/k/v and gate/up outputs are column slices of one tensor: rows are strided.
    pack, linear, _ = kernel
    base = torch.randn(9, 100).bfloat16()
    x = base[:, 10:58]
    w = torch.randn(20, 48).bfloat16()
    torch.testing.assert_close(linear(x, pack(w), 20), _reference(x, w), **BF16_STEP)


@pytest.mark.parametrize("rows", [3, 200])
def test_linear_module_keeps_leading_dims_and_bias(rows, kernel):
    module = kernel[2]
    lin = torch.nn.Linear(48, 40).bfloat16()
    mod = module(lin.weight, lin.bias)
    x = torch.randn(1, rows, 48).bfloat16()
    with torch.no_grad():
        want = _reference(x, lin.weight, lin.bias)
    got = mod(x)
    assert got.shape == (1, rows, 40) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, **BF16_STEP)


def test_launcher_refuses_what_the_kernel_cannot_read(kernel):
    pack, linear, _ = kernel
    x = torch.randn(4, 8).bfloat16()
    packed = pack(torch.randn(5, 8).bfloat16())
    with pytest.raises(AssertionError):
        linear(x.float(), packed, 5)
    with pytest.raises(AssertionError):
        linear(x, packed, 40)  # more columns than the panels hold
    with pytest.raises(AssertionError):
        linear(torch.randn(4, 9).bfloat16(), packed, 5)  # K mismatch


# amx.c itself: one and two row tiles of a block (16, 17, 31, 32 rows), blocks padded
# from x and read in place, two row chunks (300); pairs of panels, a last lone panel
# (37, 80 columns) and partial columns; K of one tile step and of many.
@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 32, 33, 48, 64, 300])
@pytest.mark.parametrize("n, k", [(96, 64), (37, 32), (16, 96), (80, 576), (130, 1536)])
def test_amx_matches_f_linear(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    packed = cpu_dpbf16.pack_weight(w)
    torch.testing.assert_close(cpu_amx.amx_linear(x, packed, n), _reference(x, w), **BF16_STEP)
    torch.testing.assert_close(cpu_amx.amx_linear(x, packed, n, b), _reference(x, w, b), **BF16_STEP)


@needs_amx
def test_amx_rounds_once_from_the_fp32_result_on_strided_rows():
    base = (torch.randn(64, 640) / 4).bfloat16()
    x = base[:, 32:608]  # a column slice, as q/k/v and gate/up are: rows 640 apart
    w = (torch.randn(960, 576) / 24).bfloat16()
    exact = F.linear(x.float(), w.float())
    err = (cpu_amx.amx_linear(x, cpu_dpbf16.pack_weight(w), 960).float() - exact).abs()
    assert (err <= exact.abs() * 2 ** -8 + 1e-6).all()


@needs_amx
def test_amx_layer_takes_tiles_only_where_they_fill(monkeypatch):
    # Below FROM_ROWS rows, and for a K no tile step divides, the layer runs vdpbf16ps;
    # from FROM_ROWS rows of a tiled K, amx.c.
    tiled = []
    real = cpu_amx.amx_linear
    monkeypatch.setattr(cpu_amx, "amx_linear", lambda x, *a: tiled.append(x.shape) or real(x, *a))
    gen = torch.Generator().manual_seed(7)
    for rows, k in ((cpu_amx.FROM_ROWS - 1, 64), (64, 72), (cpu_amx.FROM_ROWS, 64), (200, 576)):
        x, w = torch.randn(rows, k, generator=gen).bfloat16(), torch.randn(40, k, generator=gen).bfloat16()
        torch.testing.assert_close(cpu_amx.AmxLinear(w, None)(x), _reference(x, w), **BF16_STEP)
    assert tiled == [(cpu_amx.FROM_ROWS, 64), (200, 576)]


@needs_amx
def test_amx_launcher_refuses_a_k_no_tile_step_divides():
    with pytest.raises(AssertionError):
        cpu_amx.amx_linear(torch.randn(32, 40).bfloat16(), cpu_dpbf16.pack_weight(torch.randn(8, 40).bfloat16()), 8)
