"""Paged attention kernel vs the fp32 oracle and the torch path, over a grid of ragged batches."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (pip install triton==3.9.0 --no-deps)")

from loraplex.engine.kernels.triton.paged_attention import (  # noqa: E402
    reference_attention,
    reference_paged_attention,
    triton_paged_attention,
)
from loraplex.engine.kernels.torch.attention import build_metadata, build_ragged_metadata  # noqa: E402
from tests.engine.kernels.kernel_cases import paged_batch  # noqa: E402

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
# (cached prefix, query rows): decodes first, as the runner orders them, then prefill
# chunks: from scratch, after a cached prefix, single-row, and across several KV tiles.
# Context lengths are mostly not multiples of any block size.
MIXED = [(0, 1), (6, 1), (40, 1), (70, 1), (0, 13), (21, 9), (3, 1), (0, 1), (33, 40)]
DECODES = [(0, 1), (4, 1), (15, 1), (16, 1), (47, 1), (130, 1)]
GQA = [(4, 4), (4, 2), (9, 3), (8, 1)]  # (query heads, KV heads): 1, 2, 3 and 8 query heads per KV head


def _check(lens, block_size, heads, kv_heads, head_dim, dtype, config=None, seed=0):
    q, kc, vc, meta, seqs = paged_batch(lens, block_size, heads, kv_heads, head_dim, dtype, seed=seed,
                                        build=build_ragged_metadata)
    scale = head_dim ** -0.5
    out = triton_paged_attention(q, kc, vc, meta, scale, config=config)
    assert out.shape == q.shape and out.dtype == dtype
    oracle = reference_attention(q, kc, vc, seqs, block_size, scale).float()
    torch.testing.assert_close(out.float(), oracle, atol=TOL[dtype], rtol=TOL[dtype])
    reference = reference_paged_attention(q, kc, vc, build_metadata(seqs, block_size, dtype), scale)
    torch.testing.assert_close(out.float(), reference.float(),
                               atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_mixed_batch(block_size, heads, kv_heads, dtype):
    _check(MIXED, block_size, heads, kv_heads, 16, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_only_batch(block_size, dtype):
    _check(DECODES, block_size, 9, 3, 64, dtype)  # SmolLM2's heads


def test_fp16_and_padded_head_dim():
    _check(MIXED[:6], 16, 8, 2, 80, torch.float16)  # head_dim 80 pads to a 128 tile


@pytest.mark.parametrize("config", [
    {"BLOCK_M": 16, "BLOCK_Q": 4, "BLOCK_N": 16},  # many query tiles and KV tiles per sequence
    {"BLOCK_M": 32, "BLOCK_Q": 5, "BLOCK_N": 32},  # BLOCK_M not a multiple of the group
    {"BLOCK_M": 128, "BLOCK_Q": 32, "BLOCK_N": 64},
])
def test_tile_configs(config):
    _check(MIXED, 16, 12, 3, 32, torch.float32, config=config, seed=3)


def test_single_sequence_single_token():
    _check([(0, 1)], 16, 4, 2, 16, torch.float32)


def test_long_context_is_stable():
    # Large logits: the online softmax must rescale without overflow across many tiles.
    q, kc, vc, meta, seqs = paged_batch([(300, 1), (250, 7)], 16, 4, 2, 32, torch.float32, seed=5,
                                        build=build_ragged_metadata)
    q *= 30
    out = triton_paged_attention(q, kc, vc, meta, 32 ** -0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference_attention(q, kc, vc, seqs, 16, 32 ** -0.5), atol=1e-4, rtol=1e-4)


def test_launcher_rejects_bad_inputs():
    q, kc, vc, meta, _ = paged_batch([(3, 2)], 8, 4, 2, 16, torch.float32, build=build_ragged_metadata)
    with pytest.raises(AssertionError):
        triton_paged_attention(q.half(), kc, vc, meta, 0.25)
    with pytest.raises(AssertionError):
        triton_paged_attention(q[:, :3], kc, vc, meta, 0.25)  # 3 heads over 2 KV heads
    meta.block_tables = meta.block_tables.long()
    with pytest.raises(AssertionError):
        triton_paged_attention(q, kc, vc, meta, 0.25)
