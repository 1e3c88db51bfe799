"""The plain draw in C (draw.c): greedy and temperature-only rows sampled from the raw
logits the LM head wrote (bf16 or fp32), without widening them or passing over them
again in torch. `reference_plain_draw` (engine/sampler.py's torch path) is what the
tests compare it with."""
from __future__ import annotations

import ctypes

import torch

from ...sampler import draw, greedy_tokens
from . import build

_P = ctypes.c_void_p
_ARGTYPES = [_P, ctypes.c_int64, ctypes.c_int, _P, _P, _P, _P, ctypes.c_int, ctypes.c_int]
_NAMES = {torch.bfloat16: "plain_draw_bf16", torch.float32: "plain_draw_f32"}


def load_library() -> ctypes.CDLL | None:
    return build.load("draw.c", {name: _ARGTYPES for name in _NAMES.values()})


def plain_draw(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One token per row of raw [rows, vocab] logits (bf16 or fp32): the first largest
    logit where `temperature` (fp32 [rows]) is 0, else a draw from softmax(logits / T)
    by u (float64 [rows], in [0, 1)) and keys (int64 [rows], 32-bit), as sampler.py's
    `draw` makes it from the same u and key. Temperatures other than 0 are finite and at
    least the sampler's greedy bound."""
    lib = load_library()
    assert lib is not None, "load_library() returned None: use the sampler's torch path"
    rows = logits.shape[0]
    assert logits.dim() == 2 and logits.dtype in _NAMES and logits.stride(1) == 1 and logits.shape[1] > 0, \
        (logits.shape, logits.dtype)
    assert logits.device.type == "cpu", logits.device
    for t, dtype in ((temperature, torch.float32), (u, torch.float64), (keys, torch.int64)):
        assert t.dtype == dtype and t.shape == (rows,) and t.is_contiguous() and t.device.type == "cpu", \
            (t.dtype, t.shape, rows)
    tokens = torch.empty(rows, dtype=torch.int64)
    if rows:
        build.run(getattr(lib, _NAMES[logits.dtype]), (logits.data_ptr(), logits.stride(0), logits.shape[1],
                                                       temperature.data_ptr(), u.data_ptr(), keys.data_ptr(),
                                                       tokens.data_ptr()), rows)
    return tokens


def reference_plain_draw(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                         keys: torch.Tensor) -> torch.Tensor:
    """The same tokens by the sampler's torch path on the widened logits."""
    x = logits.float()
    tokens = greedy_tokens(x)
    drawn = (temperature != 0).nonzero().flatten()
    if len(drawn):
        scaled = x[drawn] - x[drawn].amax(-1, keepdim=True)
        tokens[drawn] = draw(scaled.div_(temperature[drawn, None]).exp_(), u[drawn], keys[drawn])
    return tokens
