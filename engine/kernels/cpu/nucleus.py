"""Top-p thresholds in C (nucleus.c), so a top-p row is drawn without sorting its
vocabulary; `reference_nucleus_threshold` (a sort) is what the tests compare it with."""
from __future__ import annotations

import ctypes

import torch

from . import build

_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_int, ctypes.c_int]


def load_library() -> ctypes.CDLL | None:
    return build.load("nucleus.c", {"nucleus_threshold_f32": _ARGTYPES})


def nucleus_threshold(weights: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """tau [rows]: per row of non-negative fp32 `weights` [rows, vocab], the largest
    value whose weights >= it hold at least top_p of the row's total (0 where top_p is
    1). The nucleus is `weights >= tau`: the weights outside it are set to 0 in place."""
    lib = load_library()
    assert lib is not None, "load_library() returned None: use reference_nucleus_threshold"
    assert weights.dtype == top_p.dtype == torch.float32 and weights.dim() == 2 and weights.stride(1) == 1
    assert weights.device.type == top_p.device.type == "cpu", (weights.device, top_p.device)
    assert top_p.shape == (weights.shape[0],) and top_p.is_contiguous()
    tau = torch.empty(weights.shape[0], dtype=torch.float32)
    if weights.shape[0]:
        build.run(lib.nucleus_threshold_f32, (weights.data_ptr(), weights.stride(0), weights.shape[1],
                                              top_p.data_ptr(), tau.data_ptr()), weights.shape[0])
    return tau


def reference_nucleus_threshold(weights: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The same threshold by a sort: the last weight of the sorted prefix whose sum (in
    float64) first reaches top_p of the row's total (`weights` left as they are)."""
    w = weights.double().sort(-1, descending=True).values
    cum = w.cumsum(-1)
    first = (cum < top_p.double()[:, None] * cum[:, -1:]).sum(-1).clamp(max=w.shape[1] - 1)
    tau = w.gather(1, first[:, None])[:, 0].float()
    return torch.where(top_p >= 1, torch.zeros_like(tau), tau)
