"""The AVX512-BF16 GEMM (cpu_dpbf16.c) against its reference, F.linear in fp32 on the same
bf16 values: both accumulate in fp32 and round once, so they agree to a bf16 step.
Only CPUs with AVX512-BF16 can run it; elsewhere the library builds empty and says so."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine.kernels import cpu_dpbf16

pytestmark = pytest.mark.skipif(not cpu_dpbf16.supported(), reason="this CPU has no AVX512-BF16 (or no C compiler)")

BF16_STEP = dict(rtol=2 ** -7, atol=1e-2)


def _reference(x, w, b=None):
    return F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()


# Every micro-kernel row count (1-8), a partial last block, two row chunks (256 each);
# output widths of 1-3 panels per item with a partial last panel; odd K.
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 13, 64, 300])
@pytest.mark.parametrize("n, k", [(96, 64), (37, 40), (16, 3), (1, 129), (130, 576)])
def test_matches_f_linear(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    packed = cpu_dpbf16.pack_weight(w)
    torch.testing.assert_close(cpu_dpbf16.dpbf16_linear(x, packed, n), _reference(x, w), **BF16_STEP)
    torch.testing.assert_close(cpu_dpbf16.dpbf16_linear(x, packed, n, b), _reference(x, w, b), **BF16_STEP)


def test_as_close_to_fp32_as_torchs_bf16_matmul():
    x = torch.randn(14, 576).bfloat16()
    w = (torch.randn(960, 576) / 24).bfloat16()
    exact = F.linear(x.float(), w.float())
    err = (cpu_dpbf16.dpbf16_linear(x, cpu_dpbf16.pack_weight(w), 960).float() - exact).abs().max()
    assert err <= (F.linear(x, w).float() - exact).abs().max()


def test_reads_rows_with_a_stride():
    # q/k/v and gate/up outputs are column slices of one tensor: rows are strided.
    base = torch.randn(9, 100).bfloat16()
    x = base[:, 10:58]
    w = torch.randn(20, 48).bfloat16()
    torch.testing.assert_close(cpu_dpbf16.dpbf16_linear(x, cpu_dpbf16.pack_weight(w), 20), _reference(x, w),
                               **BF16_STEP)


@pytest.mark.parametrize("rows", [3, 200])
def test_linear_module_keeps_leading_dims_and_bias(rows):
    lin = torch.nn.Linear(48, 40).bfloat16()
    mod = cpu_dpbf16.Dpbf16Linear(lin.weight, lin.bias)
    x = torch.randn(1, rows, 48).bfloat16()
    with torch.no_grad():
        want = _reference(x, lin.weight, lin.bias)
    got = mod(x)
    assert got.shape == (1, rows, 40) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, **BF16_STEP)


def test_launcher_refuses_what_the_kernel_cannot_read():
    x = torch.randn(4, 8).bfloat16()
    packed = cpu_dpbf16.pack_weight(torch.randn(5, 8).bfloat16())
    with pytest.raises(AssertionError):
        cpu_dpbf16.dpbf16_linear(x.float(), packed, 5)
    with pytest.raises(AssertionError):
        cpu_dpbf16.dpbf16_linear(x, packed, 40)  # more columns than the panels hold
    with pytest.raises(AssertionError):
        cpu_dpbf16.dpbf16_linear(torch.randn(4, 9).bfloat16(), packed, 5)  # K mismatch
