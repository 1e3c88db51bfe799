"""The C decode-attention kernel vs the fp32 per-token oracle, over a grid of batches."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels.torch.attention import paged_attention, reference_attention
from loraplex.engine.kernels.cpu.decode import cpu_decode_attention, cpu_paged_attention, load_library
from tests.engine.kernels.kernel_cases import paged_batch, same_on_one_and_four_threads

pytestmark = pytest.mark.skipif(load_library() is None, reason="no C compiler to build the CPU kernel")

TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}
# Contexts of 1, inside one block, exactly a block, across blocks, and long.
DECODES = [(0, 1), (6, 1), (15, 1), (16, 1), (40, 1), (130, 1), (700, 1)]
GQA = [(4, 4), (4, 2), (9, 3), (8, 1)]


def _check(lens, block_size, heads, kv_heads, head_dim, dtype, seed=0):
    q, kc, vc, meta, seqs = paged_batch(lens, block_size, heads, kv_heads, head_dim, dtype, seed=seed)
    out = cpu_paged_attention(q, kc, vc, meta, head_dim ** -0.5)
    oracle = reference_attention(q, kc, vc, seqs, block_size, head_dim ** -0.5).float()
    torch.testing.assert_close(out.float(), oracle, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_decodes(block_size, heads, kv_heads, dtype):
    _check(DECODES, block_size, heads, kv_heads, 32, dtype)


@pytest.mark.parametrize("head_dim", [64, 128, 48])  # the two specialised sizes and the generic loop
def test_head_dims(head_dim):
    _check(DECODES, 16, 9, 3, head_dim, torch.bfloat16, seed=head_dim)


def test_decodes_then_prefill_chunks():
    # The engine's batch order: decodes through the kernel, chunks through SDPA.
    _check(DECODES + [(0, 13), (21, 9), (0, 1)], 16, 6, 2, 32, torch.float32)


def test_q_read_in_place_from_the_fused_qkv_rows():
    # The model hands attention q as a view into its q/k/v projection output (rows further
    # apart than heads x head_dim); the kernel reads it there without a copy.
    q, kc, vc, meta, seqs = paged_batch(DECODES + [(0, 9)], 16, 6, 2, 32, torch.float32, seed=4)
    qkv = torch.cat([q.flatten(1), torch.randn(q.shape[0], 2 * 2 * 32)], dim=1)
    view = qkv[:, :6 * 32].view(q.shape)
    assert not view.is_contiguous()
    oracle = reference_attention(q, kc, vc, seqs, 16, 32 ** -0.5)
    torch.testing.assert_close(cpu_paged_attention(view, kc, vc, meta, 32 ** -0.5), oracle, **{
        "atol": TOL[torch.float32], "rtol": TOL[torch.float32]})


def test_work_split_over_threads_gives_the_same_rows():
    lens = [(i * 7 % 300, 1) for i in range(64)]
    q, kc, vc, meta, seqs = paged_batch(lens, 16, 8, 4, 32, torch.bfloat16, seed=5)
    same_on_one_and_four_threads(lambda: cpu_paged_attention(q, kc, vc, meta, 0.2))  # 256 items


def test_more_accurate_than_the_torch_path_in_bf16():
    # fp32 scores and accumulation, against bf16 rounding of scores and weights.
    q, kc, vc, meta, seqs = paged_batch([(900, 1), (33, 1)], 16, 9, 3, 64, torch.bfloat16, seed=2)
    oracle = reference_attention(q.float(), kc.float(), vc.float(), seqs, 16, 0.125)
    err_c = (cpu_paged_attention(q, kc, vc, meta, 0.125).float() - oracle).abs().max()
    err_torch = (paged_attention(q, kc, vc, meta, 0.125).float() - oracle).abs().max()
    assert err_c <= err_torch


def test_launcher_rejects_bad_inputs():
    q, kc, vc, meta, _ = paged_batch([(5, 1)], 16, 4, 2, 16, torch.float32)
    out = torch.empty_like(q)
    with pytest.raises(AssertionError):
        cpu_decode_attention(q.half(), kc, vc, out, meta.block_tables, meta.seq_lens, 16, 1.0)
    with pytest.raises(AssertionError):
        cpu_decode_attention(q, kc, vc, out, meta.block_tables.long(), meta.seq_lens, 16, 1.0)
    with pytest.raises(AssertionError):
        cpu_decode_attention(q, kc[:, :, :8].contiguous(), vc, out, meta.block_tables, meta.seq_lens, 16, 1.0)
    q_big, kc_big, vc_big, meta_big, _ = paged_batch([(5, 1)], 16, 66, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="refused its arguments"):  # 33 query heads per KV head: above the kernel's limit
        cpu_decode_attention(q_big, kc_big, vc_big, torch.empty_like(q_big), meta_big.block_tables,
                             meta_big.seq_lens, 16, 1.0)
