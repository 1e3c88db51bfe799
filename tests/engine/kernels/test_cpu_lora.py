"""The C short-segment LoRA kernel's launcher: it refuses what it cannot compute.

(Its results are checked against the per-segment torch loop in tests/engine/test_lora_batch.py,
which runs every case through this kernel and through the grouped bmm path.)"""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels import cpu_lora

pytestmark = pytest.mark.skipif(cpu_lora.load_library() is None, reason="no C compiler to build the CPU kernels")


def _args(rows=4, dtype=torch.float32):
    x = torch.randn(rows, 8, dtype=dtype)
    out = torch.zeros(rows, 6, dtype=dtype)
    a = torch.randn(1, 2, 3, 8, dtype=dtype)  # 1 layer, 2 slots, rank 3, in 8
    bt = torch.randn(1, 2, 3, 6, dtype=dtype)
    mods = torch.tensor([[0, 3, 0, 6, bt.data_ptr(), bt.stride(0)]], dtype=torch.int64)
    ranks = torch.full((1, 2, 1), 3, dtype=torch.int32)
    segs = torch.tensor([[0, rows, 1]], dtype=torch.int32)
    return x, out, segs, a, mods, ranks, bt


def test_one_segment_is_x_a_b():
    x, out, segs, a, mods, ranks, bt = _args()
    cpu_lora.cpu_lora_short(x, out, segs, a, mods, ranks, 0)
    torch.testing.assert_close(out, x @ a[0, 1].T @ bt[0, 1])


def test_rejects_wrong_dtypes_and_layouts():
    x, out, segs, a, mods, ranks, _ = _args()
    with pytest.raises(AssertionError):
        cpu_lora.cpu_lora_short(x.double(), out, segs, a, mods, ranks, 0)
    with pytest.raises(AssertionError):
        cpu_lora.cpu_lora_short(x, out, segs.long(), a, mods, ranks, 0)
    with pytest.raises(AssertionError):
        cpu_lora.cpu_lora_short(x, out, segs, a, mods, ranks, 1)  # no such layer


def test_segment_longer_than_the_kernel_takes_is_refused():
    x, out, segs, a, mods, ranks, _ = _args(rows=cpu_lora.MAX_ROWS + 1)
    with pytest.raises(ValueError, match="refused"):
        cpu_lora.cpu_lora_short(x, out, segs, a, mods, ranks, 0)
