"""The C bf16 GEMM (cpu_gemm.c) against its reference, F.linear in fp32 on the same bf16 values.

Both accumulate in fp32 and round once to bf16; only the order of the sums differs, so
results agree to a bf16 rounding step.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine.kernels import cpu_gemm

pytestmark = pytest.mark.skipif(cpu_gemm.load_library() is None, reason="no C compiler to build the CPU kernels")

BF16_STEP = dict(rtol=2 ** -7, atol=1e-2)


def _reference(x, w, b=None):
    return F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64, 300])  # every micro-kernel row count, tails, two row chunks
@pytest.mark.parametrize("n, k", [(96, 64), (37, 40), (16, 3), (1, 129)])  # partial panels, odd K
def test_matches_f_linear(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    packed = cpu_gemm.pack_weight(w)
    torch.testing.assert_close(cpu_gemm.cpu_gemm_bf16(x, packed, n), _reference(x, w), **BF16_STEP)
    torch.testing.assert_close(cpu_gemm.cpu_gemm_bf16(x, packed, n, b), _reference(x, w, b), **BF16_STEP)


def test_reads_rows_with_a_stride():
    # q/k/v and gate/up outputs are column slices of one tensor: rows are strided.
    base = torch.randn(9, 100).bfloat16()
    x = base[:, 10:58]
    w = torch.randn(20, 48).bfloat16()
    torch.testing.assert_close(cpu_gemm.cpu_gemm_bf16(x, cpu_gemm.pack_weight(w), 20), _reference(x, w), **BF16_STEP)


@pytest.mark.parametrize("rows", [3, 200])
def test_linear_module_keeps_leading_dims_and_bias(rows):
    lin = torch.nn.Linear(48, 40).bfloat16()
    mod = cpu_gemm.Bf16Linear(lin.weight, lin.bias)
    x = torch.randn(1, rows, 48).bfloat16()
    with torch.no_grad():
        want = _reference(x, lin.weight, lin.bias)
    got = mod(x)
    assert got.shape == (1, rows, 40) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, **BF16_STEP)


def test_launcher_refuses_what_the_kernel_cannot_read():
    x = torch.randn(4, 8).bfloat16()
    packed = cpu_gemm.pack_weight(torch.randn(5, 8).bfloat16())
    with pytest.raises(AssertionError):
        cpu_gemm.cpu_gemm_bf16(x.float(), packed, 5)
    with pytest.raises(AssertionError):
        cpu_gemm.cpu_gemm_bf16(x, packed, 40)  # more columns than the panels hold
    with pytest.raises(AssertionError):
        cpu_gemm.cpu_gemm_bf16(torch.randn(4, 9).bfloat16(), packed, 5)  # K mismatch
