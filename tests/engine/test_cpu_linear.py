"""Pre-packed oneDNN linears give the same numbers as F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engine.cpu_linear import PackedLinear, pack_linears, packing_supported

pytestmark = pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.bfloat16),
                                reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 48, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, 48, generator=gen).bfloat16()
    torch.testing.assert_close(PackedLinear(w, b)(x), F.linear(x, w, b), atol=0, rtol=0)


def test_leading_dims_are_kept():
    w = torch.randn(8, 4).bfloat16()
    x = torch.randn(2, 3, 4).bfloat16()
    assert PackedLinear(w, None)(x).shape == (2, 3, 8)


def test_pack_linears_replaces_nested_layers():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 2, bias=False))).bfloat16()
    x = torch.randn(3, 4).bfloat16()
    with torch.no_grad():
        want = model(x)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), want, atol=0, rtol=0)
