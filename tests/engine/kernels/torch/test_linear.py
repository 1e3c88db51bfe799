"""Pre-packed oneDNN linears give the same numbers as F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engine.kernels.torch.linear import PackedLinear, WideLinear, pack_linears, packing_supported, widening_supported

needs_packing = pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.bfloat16),
                                   reason="oneDNN cannot pack bf16 weights on this CPU (no AVX-512)")


def test_support_check_never_promises_what_onednn_refuses():
    # An AVX2-only CPU (this fleet's EPYCs) has oneDNN but cannot pack bf16: the check
    # must say so instead of letting the engine crash at load.
    for dtype in (torch.bfloat16, torch.float16):
        if packing_supported(torch.device("cpu"), dtype):
            PackedLinear(torch.randn(32, 16).to(dtype), None)
    assert not packing_supported(torch.device("cpu"), torch.float32)
    assert not packing_supported(torch.device("meta"), torch.bfloat16)


@needs_packing
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 48, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, 48, generator=gen).bfloat16()
    torch.testing.assert_close(PackedLinear(w, b)(x), F.linear(x, w, b), atol=0, rtol=0)


@needs_packing
def test_leading_dims_are_kept():
    w = torch.randn(8, 4).bfloat16()
    x = torch.randn(2, 3, 4).bfloat16()
    assert PackedLinear(w, None)(x).shape == (2, 3, 8)


@needs_packing
def test_pack_linears_replaces_nested_layers():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 2, bias=False))).bfloat16()
    x = torch.randn(3, 4).bfloat16()
    with torch.no_grad():
        want = model(x)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), want, atol=0, rtol=0)


needs_widening = pytest.mark.skipif(not widening_supported(torch.device("cpu"), torch.bfloat16),
                                    reason="oneDNN cannot pack fp32 weights here")


@needs_widening
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widened_is_the_fp32_product_of_the_same_values_rounded_once(rows, bias, dtype):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 48, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, 48, generator=gen).to(dtype)
    y = WideLinear(w, b)(x)
    assert y.dtype == dtype and y.shape == (rows, 96)
    # The reference: every product exact in fp32, fp32 sums, one rounding. Only the order
    # of the sums may differ, so at most one unit in the last place of the result's dtype.
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(y.float(), want.to(dtype).float(), atol=1e-6, rtol=2 * torch.finfo(dtype).eps)


@needs_widening
def test_widened_keeps_leading_dims_and_matches_the_packed_bf16_matmul():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=gen).bfloat16()
    x = torch.randn(2, 3, 32, generator=gen).bfloat16()
    y = WideLinear(w, None)(x)
    assert y.shape == (2, 3, 64)
    torch.testing.assert_close(y, F.linear(x, w), atol=1e-6, rtol=2 * torch.finfo(torch.bfloat16).eps)


def test_which_layers_build_state_per_shape():
    # oneDNN builds a primitive per shape (the packed kernels; a plain layer in bf16/fp16 on
    # a CPU); BLAS sgemm (fp32 on a CPU) and the C kernels build nothing.
    from loraplex.engine.kernels import builds_state_per_shape
    from loraplex.engine.kernels.cpu import gemm
    from loraplex.engine.kernels.cpu.linear_choice import SplitLinear

    assert not builds_state_per_shape(nn.Linear(16, 32))
    assert not builds_state_per_shape(nn.Embedding(32, 16))
    assert builds_state_per_shape(nn.Linear(16, 32).bfloat16())
    assert builds_state_per_shape(nn.Embedding(32, 16).half())
    assert PackedLinear.per_shape_state and WideLinear.per_shape_state and not gemm.Bf16Linear.per_shape_state
    if gemm.load_library() and widening_supported(torch.device("cpu"), torch.bfloat16):
        w = torch.randn(32, 16).bfloat16()
        assert builds_state_per_shape(SplitLinear(w, None, gemm.Bf16Linear, WideLinear, 8))
        assert not builds_state_per_shape(SplitLinear(w, None, gemm.Bf16Linear, gemm.Bf16Linear, 8))
