"""Top-k and top-p thresholds in C (nucleus.c), so a filtered row is drawn without
sorting its vocabulary; `reference_nucleus_threshold` (a sort) is what the tests compare
it with."""
from __future__ import annotations

import ctypes

import torch

from . import build

_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_int, ctypes.c_int]


def load_library() -> ctypes.CDLL | None:
    return build.load("nucleus.c", {"nucleus_threshold_f32": _ARGTYPES})


def nucleus_threshold(weights: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """tau [rows]: per row of non-negative fp32 `weights` [rows, vocab], top-k's k-th
    largest weight (top_k int32, 0: none), then over what it kept the largest value
    whose weights >= it hold at least top_p of their total (1: none); 0 where neither
    applies. The nucleus is `weights >= tau`: the weights outside it are set to 0 in place."""
    lib = load_library()
    assert lib is not None, "load_library() returned None: use reference_nucleus_threshold"
    assert weights.dtype == top_p.dtype == torch.float32 and weights.dim() == 2 and weights.stride(1) == 1
    assert weights.device.type == top_p.device.type == top_k.device.type == "cpu", (weights.device, top_p.device)
    assert top_p.shape == top_k.shape == (weights.shape[0],) and top_p.is_contiguous() and top_k.is_contiguous()
    assert top_k.dtype == torch.int32, top_k.dtype
    tau = torch.empty(weights.shape[0], dtype=torch.float32)
    if weights.shape[0]:
        build.run(lib.nucleus_threshold_f32, (weights.data_ptr(), weights.stride(0), weights.shape[1],
                                              top_k.data_ptr(), top_p.data_ptr(), tau.data_ptr()), weights.shape[0])
    return tau


def reference_nucleus_threshold(weights: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """The same threshold by a sort: the k-th largest weight, then the last weight of
    the sorted prefix whose sum (in float64) first reaches top_p of what top-k kept
    (`weights` left as they are)."""
    w = weights.double().sort(-1, descending=True).values
    vocab = w.shape[1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k.long(), vocab)
    tau_k = torch.where(k < vocab, w.gather(1, (k - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    w = torch.where(w >= tau_k[:, None], w, 0.0)
    cum = w.cumsum(-1)
    first = (cum < top_p.double()[:, None] * cum[:, -1:]).sum(-1).clamp(max=vocab - 1)
    tau = torch.where(top_p < 1, w.gather(1, first[:, None])[:, 0], tau_k)
    return tau.float()
