"""The bf16 linear each row count gets on this CPU: the measured crossover between the C
kernel and oneDNN, and the split layer that follows it."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels.cpu import dpbf16, linear_choice as lc
from loraplex.engine.kernels.torch.linear import PackedLinear, packing_supported

both = pytest.mark.skipif(not (dpbf16.supported() and packing_supported(torch.device("cpu"), torch.bfloat16)),
                          reason="needs the AVX512-BF16 C kernel and oneDNN's bf16 packing")


def test_onednn_takes_over_only_where_it_is_clearly_faster_from_there_on():
    amx_like = {1: (1.0, 1.5), 4: (1.2, 1.3), 8: (2.0, 1.0), 16: (4.0, 1.0), 64: (16.0, 1.5)}
    assert lc.crossover(amx_like) == 8
    epyc_like = {1: (1.0, 2.0), 16: (2.0, 2.2), 64: (8.0, 7.5), 128: (16.0, 15.0)}  # faster, within noise
    assert lc.crossover(epyc_like) is None
    # a win below a loss does not count: from 16 rows on it must win everywhere
    assert lc.crossover({1: (1.0, 0.5), 4: (1.0, 2.0), 16: (4.0, 1.0), 64: (16.0, 2.0)}) == 16
    assert lc.crossover({1: (2.0, 1.0), 64: (9.0, 1.0)}) == 1  # oneDNN everywhere


@both
def test_the_measured_choice_is_a_measured_row_count_and_kept_per_thread_count():
    start = lc.onednn_from_rows()
    assert start is None or start in lc.ROWS
    assert lc.onednn_from_rows() == start  # measured once
    make = lc.linear_for_this_cpu()
    layer = make(torch.randn(40, 24).bfloat16(), None)
    expected = {None: dpbf16.Dpbf16Linear, 1: PackedLinear}.get(start, lc.SplitLinear)
    assert type(layer) is expected


@both
@pytest.mark.parametrize("bias", [False, True])
def test_the_split_layer_is_each_kernel_on_its_side_of_the_crossover(bias):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(72, 40, generator=gen).bfloat16()
    b = torch.randn(72, generator=gen).bfloat16() if bias else None
    split = lc.SplitLinear(w, b, from_rows=8)
    few, many = dpbf16.Dpbf16Linear(w, b), PackedLinear(w, b)
    for rows in (1, 7, 8, 33):
        x = torch.randn(rows, 40, generator=gen).bfloat16()
        want = (many if rows >= 8 else few)(x)
        torch.testing.assert_close(split(x), want, atol=0, rtol=0)
    x3 = torch.randn(2, 5, 40, generator=gen).bfloat16()  # leading dims: 10 rows
    torch.testing.assert_close(split(x3), many(x3), atol=0, rtol=0)
    assert split(x3).shape == (2, 5, 72)
