"""The elementwise steps of a decoder layer in torch ops (RMSNorm with the residual add,
RoPE, SiLU-and-multiply): the reference of kernels/cpu/fused.py's `CLayerOps`, and what
runs on GPUs."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as transformers (fp32 variance, cast back before the weight) so
    # bf16 results match the oracle bit for bit where possible.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim] (non-interleaved halves)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TorchLayerOps:
    """A layer's elementwise steps in torch ops: the reference, and what runs on GPUs.
    kernels/cpu/fused.py's CLayerOps fuses each of them on a CPU."""

    @staticmethod
    def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            x = x + delta
        return x, rms_norm(x, weight, eps)

    @staticmethod
    def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        T, q, kv = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
        return (apply_rope(qkv[:, :q].view(T, num_heads, head_dim), cos, sin),
                apply_rope(qkv[:, q:q + kv].view(T, num_kv_heads, head_dim), cos, sin))

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        g, u = gate_up.chunk(2, dim=-1)
        return F.silu(g) * u
