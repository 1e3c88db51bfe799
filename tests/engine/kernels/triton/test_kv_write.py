"""KV cache write kernel vs the torch path: bit-exact copies into scattered slots."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (pip install triton==3.9.0 --no-deps)")

from loraplex.engine.kernels.triton.kv_write import reference_write_kv, triton_write_kv  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads,head_dim", [(1, 16), (2, 64), (3, 80)])
def test_write_matches_torch(dtype, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(kv_heads * head_dim)
    T, slots = 11, 64
    slot_mapping = torch.randperm(slots, generator=gen)[:T]
    # v as the engine passes it: a strided view of a fused q/k/v projection output.
    fused = torch.randn(T, 2 * kv_heads + 1, head_dim, generator=gen).to(dtype)
    k, v = fused[:, :kv_heads].contiguous(), fused[:, kv_heads + 1:]
    caches = [torch.randn(kv_heads, slots, head_dim, generator=gen).to(dtype) for _ in range(2)]
    expect = [c.clone() for c in caches]
    reference_write_kv(*expect, k, v, slot_mapping)
    triton_write_kv(*caches, k, v, slot_mapping.to(torch.int32))
    assert torch.equal(caches[0], expect[0]) and torch.equal(caches[1], expect[1])


def test_negative_slots_are_skipped():
    k = torch.ones(3, 2, 16)
    k_cache, v_cache = torch.zeros(2, 8, 16), torch.zeros(2, 8, 16)
    triton_write_kv(k_cache, v_cache, k, 2 * k, torch.tensor([5, -1, 0]))
    assert k_cache[:, [0, 5]].eq(1).all() and v_cache[:, [0, 5]].eq(2).all()
    assert k_cache.sum() == 2 * 2 * 16


def test_launcher_rejects_mismatches():
    k = torch.zeros(2, 2, 16)
    cache = torch.zeros(2, 8, 16)
    with pytest.raises(AssertionError):
        triton_write_kv(cache, cache.clone(), k.half(), k.half(), torch.tensor([0, 1]))  # dtype
    with pytest.raises(AssertionError):
        triton_write_kv(cache, cache.clone(), k, k, torch.tensor([0]))  # slot count
    with pytest.raises(AssertionError):
        triton_write_kv(cache, cache.clone(), k.transpose(1, 2), k.transpose(1, 2), torch.tensor([0, 1]))  # shape
