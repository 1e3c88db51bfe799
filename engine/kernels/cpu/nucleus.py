"""Min-p, top-k and top-p thresholds in C (nucleus.c), so a filtered row is drawn
without sorting its vocabulary; `reference_nucleus_threshold` (a sort) is what the tests
compare it with."""
from __future__ import annotations

import ctypes

import torch

from . import build

_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_int]


def load_library() -> ctypes.CDLL | None:
    return build.load("nucleus.c", {"nucleus_threshold_f32": _ARGTYPES})


def nucleus_threshold(weights: torch.Tensor, min_p: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """tau [rows]: per row of non-negative fp32 `weights` [rows, vocab] whose largest is
    1, min-p's floor (min_p fp32, 0: none), then top-k's k-th largest weight (top_k
    int32, 0: none), then over what those kept the largest value whose weights >= it
    hold at least top_p of their total (1: none); 0 where none applies. The kept tokens
    are `weights >= tau`: the weights outside are set to 0 in place."""
    lib = load_library()
    assert lib is not None, "load_library() returned None: use reference_nucleus_threshold"
    rows = weights.shape[0]
    assert weights.dtype == min_p.dtype == top_p.dtype == torch.float32 and top_k.dtype == torch.int32
    assert weights.dim() == 2 and weights.stride(1) == 1 and weights.device.type == "cpu", (weights.shape, weights.device)
    for t in (min_p, top_k, top_p):
        assert t.shape == (rows,) and t.is_contiguous() and t.device.type == "cpu", (t.shape, rows)
    tau = torch.empty(rows, dtype=torch.float32)
    if rows:
        build.run(lib.nucleus_threshold_f32, (weights.data_ptr(), weights.stride(0), weights.shape[1], min_p.data_ptr(),
                                              top_k.data_ptr(), top_p.data_ptr(), tau.data_ptr()), rows)
    return tau


def reference_nucleus_threshold(weights: torch.Tensor, min_p: torch.Tensor, top_k: torch.Tensor,
                                top_p: torch.Tensor) -> torch.Tensor:
    """The same threshold by a sort: the min-p floor, the k-th largest weight above it,
    then the last weight of the sorted prefix whose sum (in float64) first reaches top_p
    of what those kept (`weights` left as they are)."""
    floor = min_p.double()[:, None]
    w = torch.where(weights.double() >= floor, weights.double(), 0.0).sort(-1, descending=True).values
    vocab = w.shape[1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k.long(), vocab)
    tau_k = torch.where(k < vocab, w.gather(1, (k - 1).clamp(min=0)[:, None])[:, 0], 0.0).maximum(floor[:, 0])
    w = torch.where(w >= tau_k[:, None], w, 0.0)
    cum = w.cumsum(-1)
    first = (cum < top_p.double()[:, None] * cum[:, -1:]).sum(-1).clamp(max=vocab - 1)
    return torch.where(top_p < 1, w.gather(1, first[:, None])[:, 0], tau_k).float()
