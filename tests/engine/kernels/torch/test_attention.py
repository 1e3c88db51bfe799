"""The CPU attention path: decode groups and prefill chunks against the fp32 per-token loop."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from loraplex.engine.kernels.torch.attention import GROUP_COST_BLOCKS, group_decodes, paged_attention, reference_attention

from ..kernel_cases import paged_batch


def _cost(groups: list[list[int]], blocks: list[int]) -> int:
    return sum(GROUP_COST_BLOCKS + len(g) * max(blocks[i] for i in g) for g in groups)


def _best_cost_by_brute_force(blocks: list[int]) -> int:
    # Optimal groups are runs of the sorted order; try every set of cut points.
    order = sorted(range(len(blocks)), key=blocks.__getitem__)
    best = None
    for cuts in itertools.product((False, True), repeat=len(order) - 1):
        groups, cur = [], [order[0]]
        for i, cut in zip(order[1:], cuts):
            if cut:
                groups.append(cur)
                cur = []
            cur.append(i)
        groups.append(cur)
        c = _cost(groups, blocks)
        best = c if best is None else min(best, c)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_decode_groups_partition_and_are_optimal(seed):
    rnd = random.Random(seed)
    blocks = [rnd.choice([1, 2, 3, 40, 41, 200, 300]) for _ in range(10)]
    groups = group_decodes(blocks)
    assert sorted(i for g in groups for i in g) == list(range(len(blocks)))
    assert _cost(groups, blocks) == _best_cost_by_brute_force(blocks)


def test_similar_lengths_share_one_group_and_outliers_split():
    assert len(group_decodes([5, 6, 5, 7])) == 1
    groups = group_decodes([2] * 50 + [400])
    assert len(groups) == 2 and groups[-1] == [50]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heavy_tailed_decodes_and_prefills_match_reference(dtype):
    # Short and very long contexts interleaved: several decode groups whose query rows
    # are not contiguous in the batch, then prefill chunks with and without a cached prefix.
    decodes = [(3, 1), (900, 1), (17, 1), (1500, 1), (15, 1), (31, 1), (1000, 1), (64, 1)]
    lens = decodes + [(0, 37), (40, 9), (0, 1)]
    q, kc, vc, meta, seqs = paged_batch(lens, 16, 6, 2, 32, dtype, seed=3)
    assert len(meta.decode_groups) >= 2
    assert any(g.rows is not None for g in meta.decode_groups)
    got = paged_attention(q, kc, vc, meta, 32 ** -0.5)
    want = reference_attention(q, kc, vc, seqs, 16, 32 ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_decode_exactly_filling_its_blocks_needs_no_mask():
    q, kc, vc, meta, seqs = paged_batch([(31, 1), (31, 1)], 16, 4, 4, 16, torch.float32, seed=1)
    assert all(g.mask is None for g in meta.decode_groups)
    torch.testing.assert_close(paged_attention(q, kc, vc, meta, 0.25), reference_attention(q, kc, vc, seqs, 16, 0.25))
