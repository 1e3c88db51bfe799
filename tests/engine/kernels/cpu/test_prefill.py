"""The C prefill-attention kernel vs the fp32 per-token oracle, over a grid of chunks."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels.torch.attention import reference_attention
from loraplex.engine.kernels.cpu import decode as cpu_decode, prefill as cpu_prefill, prefill_amx
from tests.engine.kernels.kernel_cases import (MARCHES, assert_as_accurate_as_sdpa, paged_batch,
                                              same_on_one_and_four_threads, use_build)

pytestmark = pytest.mark.skipif(cpu_prefill.load_library() is None, reason="no C compiler to build the CPU kernel")


@pytest.fixture(autouse=True)
def without_amx(monkeypatch):
    """prefill.c itself, also on CPUs where bf16 chunks would take prefill_amx.c's tiles
    (tested in test_prefill_amx.py)."""
    monkeypatch.setattr(prefill_amx, "supports", lambda q, k_cache: False)


@pytest.fixture(params=MARCHES)
def code_path(request, monkeypatch) -> str:
    """The kernel built for this CPU, and its AVX2 and plain x86-64 builds where this CPU
    runs them (16 lanes, 8 lanes): a machine only ever builds one of them."""
    use_build(monkeypatch, cpu_prefill, "prefill.c", {n: cpu_prefill._ARGTYPES for n in
                                                          ("paged_prefill_bf16", "paged_prefill_f32")}, request.param)
    return request.param

TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}
# Fresh prompts and continued chunks (a cached prefix: chunked prefill, prefix-cache
# hits), lengths inside one block, across blocks, one row, and not a multiple of the
# rows a work item takes; decodes first, as the engine orders a batch.
CHUNKS = [(3, 1), (40, 1), (0, 1), (0, 13), (21, 9), (0, 16), (16, 17), (0, 70), (130, 33)]
GQA = [(4, 4), (4, 2), (9, 3), (8, 1), (32, 1)]  # 32: one row per work item


def _check(lens, block_size, heads, kv_heads, head_dim, dtype, seed=0):
    q, kc, vc, meta, seqs = paged_batch(lens, block_size, heads, kv_heads, head_dim, dtype, seed=seed)
    out = cpu_decode.cpu_paged_attention(q, kc, vc, meta, head_dim ** -0.5)
    oracle = reference_attention(q, kc, vc, seqs, block_size, head_dim ** -0.5).float()
    torch.testing.assert_close(out.float(), oracle, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_chunks(block_size, heads, kv_heads, dtype, code_path):
    _check(CHUNKS, block_size, heads, kv_heads, 32, dtype)


# 64 and 128 fill the P V register tiles; 48 and 80 also take the plain loop for the rest.
@pytest.mark.parametrize("head_dim", [64, 128, 48, 80])
def test_head_dims(head_dim, code_path):
    _check(CHUNKS, 16, 9, 3, head_dim, torch.bfloat16, seed=head_dim)


def test_long_prompt():
    _check([(0, 1), (0, 300), (200, 100)], 16, 9, 3, 64, torch.bfloat16, seed=7)


def test_chunks_run_on_the_kernel_not_sdpa(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the torch path ran")

    monkeypatch.setattr(cpu_decode, "prefill_attention", fail)
    _check([(0, 40), (8, 8)], 16, 4, 2, 32, torch.float32)


def test_q_read_in_place_from_the_fused_qkv_rows():
    q, kc, vc, meta, seqs = paged_batch([(0, 30), (9, 12)], 16, 6, 2, 32, torch.float32, seed=4)
    qkv = torch.cat([q.flatten(1), torch.randn(q.shape[0], 2 * 2 * 32)], dim=1)
    view = qkv[:, :6 * 32].view(q.shape)
    assert not view.is_contiguous()
    oracle = reference_attention(q, kc, vc, seqs, 16, 32 ** -0.5)
    torch.testing.assert_close(cpu_decode.cpu_paged_attention(view, kc, vc, meta, 32 ** -0.5), oracle,
                               atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_work_split_over_threads_gives_the_same_rows():
    q, kc, vc, meta, _ = paged_batch([(0, 200), (50, 61), (0, 5)], 16, 8, 4, 32, torch.bfloat16, seed=5)
    same_on_one_and_four_threads(lambda: cpu_decode.cpu_paged_attention(q, kc, vc, meta, 0.2))


def test_as_accurate_as_sdpa_in_bf16():
    # fp32 scores, softmax and accumulation, one rounding at the end.
    assert_as_accurate_as_sdpa(cpu_prefill.cpu_prefill_attention)


def test_launcher_rejects_bad_inputs():
    q, kc, vc, meta, _ = paged_batch([(0, 5)], 16, 4, 2, 16, torch.float32)
    out = torch.empty_like(q)
    with pytest.raises(AssertionError):
        cpu_prefill.cpu_prefill_attention(q.half(), kc, vc, meta, 1.0, out)
    with pytest.raises(AssertionError):
        cpu_prefill.cpu_prefill_attention(q, kc[:, :, :8].contiguous(), vc, meta, 1.0, out)
    with pytest.raises(AssertionError):
        cpu_prefill.cpu_prefill_attention(q, kc, vc, meta, 1.0, out[:, :2])
    # 66 query heads per KV head: more than a work item holds, so the engine keeps SDPA
    q_big, kc_big, _, _, _ = paged_batch([(0, 3)], 16, 66, 1, 16, torch.float32)
    assert not cpu_prefill.supports(q_big, kc_big)
