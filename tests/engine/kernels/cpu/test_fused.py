"""The C elementwise layer steps vs TorchLayerOps (their reference) and the torch KV write."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels.torch.attention import write_kv
from loraplex.engine.kernels.cpu import fused
from loraplex.engine.kernels.cpu.fused import CLayerOps, cpu_write_kv, load_library
from loraplex.engine.models.llama import TorchLayerOps
from tests.engine.kernels.kernel_cases import use_build

pytestmark = pytest.mark.skipif(load_library() is None, reason="no C compiler to build the CPU kernels")

# bf16 results may differ by one rounding step where the sum of squares or exp is
# computed in another order; fp32 agrees to float precision.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=["native", "skylake-avx512", "x86-64-v3"])
def code_path(request, monkeypatch) -> str:
    """The kernels built for this CPU, and where it runs them its AVX-512 build without
    bf16 instructions (narrowing by hand) and its AVX2 build (the compiler's loops)."""
    use_build(monkeypatch, fused, "fused.c", fused._SIGNATURES, request.param)
    return request.param


def _randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("hidden", [96, 100])  # whole vectors of 16, and a scalar tail
def test_add_rms_norm(dtype, rows, with_delta, hidden, code_path):
    x, w = _randn(rows, hidden, dtype=dtype), _randn(hidden, dtype=dtype, seed=1)
    delta = _randn(rows, hidden, dtype=dtype, seed=2) if with_delta else None
    want_x, want = TorchLayerOps.add_rms_norm(x.clone(), delta, w, 1e-5)
    x_c = x.clone()
    got_x, got = CLayerOps(dtype).add_rms_norm(x_c, delta, w, 1e-5)
    assert got_x.data_ptr() == x_c.data_ptr(), "the residual sum is written in place"
    torch.testing.assert_close(got_x, want_x, atol=0, rtol=0)  # one rounded add: exact
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
# 64 and 128: whole vectors of 16 per half; 16 and 40: the scalar loop.
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 2, 128), (2, 1, 40)])
def test_rope_in_place(dtype, heads, kv_heads, head_dim, code_path):
    T = 70
    qkv = _randn(T, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    pos = torch.arange(T, dtype=torch.float32)[:, None] * torch.rand(head_dim // 2)[None, :]
    emb = torch.cat((pos, pos), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
    want_q, want_k = TorchLayerOps.rope(qkv.clone(), cos, sin, heads, kv_heads, head_dim)
    fused = qkv.clone()
    got_q, got_k = CLayerOps(dtype).rope(fused, cos, sin, heads, kv_heads, head_dim)
    # bf16 rounds after each product and the sum, as torch does: exact. fp32 may fuse a
    # multiply-add (one rounding fewer).
    exact = dict(atol=0, rtol=0) if dtype == torch.bfloat16 else TOL[dtype]
    torch.testing.assert_close(got_q, want_q, **exact)
    torch.testing.assert_close(got_k, want_k, **exact)
    v = (heads + kv_heads) * head_dim
    torch.testing.assert_close(fused[:, v:], qkv[:, v:], atol=0, rtol=0)  # V is left alone


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [4.0, 1000.0])
@pytest.mark.parametrize("width", [80, 85])  # whole vectors of 16, and a scalar tail
def test_silu_mul(dtype, scale, width, code_path):
    # Large gate values once made exp(-x) overflow, which the kernel's fast math turned
    # into NaN (an untrained adapter's activations reach such values).
    gu = _randn(130, 2 * width, dtype=dtype) * scale
    got = CLayerOps(dtype).silu_mul(gu)
    assert not got.isnan().any()
    torch.testing.assert_close(got, TorchLayerOps.silu_mul(gu), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_from_qkv_views(dtype):
    T, kvh, dh, slots = 9, 3, 16, 64
    qkv = _randn(T, (4 + 2 * kvh) * dh, dtype=dtype)
    k = qkv[:, 4 * dh:(4 + kvh) * dh].view(T, kvh, dh)
    v = qkv[:, (4 + kvh) * dh:].view(T, kvh, dh)
    slot_mapping = torch.randperm(slots)[:T]
    want = [torch.zeros(kvh, slots, dh, dtype=dtype) for _ in range(2)]
    got = [torch.zeros(kvh, slots, dh, dtype=dtype) for _ in range(2)]
    write_kv(*want, k, v, slot_mapping)
    cpu_write_kv(*got, k, v, slot_mapping)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_write_kv_refuses_a_slot_outside_the_cache():
    k = torch.zeros(2, 1, 8)
    cache = [torch.zeros(1, 16, 8), torch.zeros(1, 16, 8)]
    with pytest.raises(ValueError, match="refused"):
        cpu_write_kv(*cache, k, k.clone(), torch.tensor([3, 16]))


def test_launchers_reject_bad_inputs():
    ops = CLayerOps(torch.float32)
    with pytest.raises(AssertionError):
        ops.add_rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16), None, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(AssertionError):
        ops.add_rms_norm(torch.zeros(8, 2).t(), None, torch.ones(8), 1e-5)  # not contiguous
    with pytest.raises(AssertionError):
        ops.silu_mul(torch.zeros(2, 7))
