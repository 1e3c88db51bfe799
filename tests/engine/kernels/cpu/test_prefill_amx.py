"""The AMX prefill-attention kernel vs the fp32 per-token oracle, on CPUs with AMX."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels.cpu import decode as cpu_decode, prefill as cpu_prefill, prefill_amx
from loraplex.engine.kernels.torch.attention import reference_attention
from tests.engine.kernels.kernel_cases import assert_as_accurate_as_sdpa, paged_batch, same_on_one_and_four_threads

pytestmark = pytest.mark.skipif(not prefill_amx.supported(), reason="this CPU has no AMX (or no C compiler)")

TOL = 1e-2  # bf16, as test_prefill.py
# Fresh prompts and continued chunks (cached prefixes), lengths inside one key tile, across
# tiles and blocks, one row, and not a multiple of the rows a work item takes; decodes first.
CHUNKS = [(3, 1), (40, 1), (0, 1), (0, 13), (21, 9), (0, 16), (16, 17), (0, 70), (130, 33)]
GQA = [(4, 4), (4, 2), (9, 3), (8, 1), (32, 1)]


@pytest.fixture(autouse=True)
def only_the_amx_kernel(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("prefill.c ran, not prefill_amx.c")

    monkeypatch.setattr(cpu_prefill, "cpu_prefill_attention", fail)


def _check(lens, block_size, heads, kv_heads, head_dim, seed=0):
    q, kc, vc, meta, seqs = paged_batch(lens, block_size, heads, kv_heads, head_dim, torch.bfloat16, seed=seed)
    out = cpu_decode.cpu_paged_attention(q, kc, vc, meta, head_dim ** -0.5)
    oracle = reference_attention(q, kc, vc, seqs, block_size, head_dim ** -0.5).float()
    torch.testing.assert_close(out.float(), oracle, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_chunks(block_size, heads, kv_heads, head_dim):
    _check(CHUNKS, block_size, heads, kv_heads, head_dim, seed=block_size + heads + head_dim)


def test_long_prompts():
    _check([(0, 1), (0, 300), (200, 100), (0, 1024)], 16, 9, 3, 64, seed=7)


def test_only_tiled_head_sizes_and_bf16_take_it():
    q, kc, _, _, _ = paged_batch([(0, 4)], 16, 9, 3, 48, torch.bfloat16)
    assert not prefill_amx.supports(q, kc)  # 48 dims: not whole steps of 32
    q, kc, _, _, _ = paged_batch([(0, 4)], 16, 9, 3, 64, torch.float32)
    assert not prefill_amx.supports(q, kc)
    q, kc, _, _, _ = paged_batch([(0, 4)], 16, 9, 3, 64, torch.bfloat16)
    assert prefill_amx.supports(q, kc)


def test_keys_past_the_context_are_never_read():
    # The spare blocks (and the tail of each last block) hold NaN: a key tile or a pair of
    # V rows that reached past a chunk's context would turn its rows to NaN (0 x NaN).
    q, kc, vc, meta, seqs = paged_batch([(5, 11), (0, 37), (20, 3)], 16, 9, 3, 64, torch.bfloat16, seed=3,
                                        spare_blocks=4)
    used = torch.zeros(kc.shape[1], dtype=torch.bool)
    for start, n, blocks in seqs:
        for t in range(start + n):
            used[blocks[t // 16] * 16 + t % 16] = True
    kc[:, ~used], vc[:, ~used] = float("nan"), float("nan")
    out = cpu_decode.cpu_paged_attention(q, kc, vc, meta, 0.125)
    oracle = reference_attention(q, kc, vc, seqs, 16, 0.125).float()
    torch.testing.assert_close(out.float(), oracle, atol=TOL, rtol=TOL)


def test_work_split_over_threads_gives_the_same_rows():
    q, kc, vc, meta, _ = paged_batch([(0, 200), (50, 61), (0, 5)], 16, 8, 4, 64, torch.bfloat16, seed=5)
    same_on_one_and_four_threads(lambda: cpu_decode.cpu_paged_attention(q, kc, vc, meta, 0.2))


def test_as_accurate_as_sdpa_in_bf16():
    # fp32 scores and softmax; the weights rounded to bf16 for P V as SDPA's bf16 matmul does.
    assert_as_accurate_as_sdpa(prefill_amx.amx_prefill_attention)


def test_launcher_rejects_bad_inputs():
    q, kc, vc, meta, _ = paged_batch([(0, 5)], 16, 4, 2, 32, torch.bfloat16)
    out = torch.empty_like(q)
    with pytest.raises(AssertionError):
        prefill_amx.amx_prefill_attention(q.float(), kc, vc, meta, 1.0, out)
    with pytest.raises(AssertionError):
        prefill_amx.amx_prefill_attention(q, kc, vc, meta, 1.0, out[:, :2])
    with pytest.raises(AssertionError):
        prefill_amx.amx_prefill_attention(q, kc[:, :, :16].contiguous(), vc, meta, 1.0, out)
