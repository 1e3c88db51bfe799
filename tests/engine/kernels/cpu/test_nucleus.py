"""The C min-p / top-k / top-p threshold (nucleus.c) against its reference, a sort."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels.cpu.nucleus import load_library, nucleus_threshold, reference_nucleus_threshold

pytestmark = pytest.mark.skipif(load_library() is None, reason="no C compiler to build the CPU kernel")


def _weights(rows: int, vocab: int, scale: float, seed: int) -> torch.Tensor:
    # bf16 logits, as a bf16 model's: many exact ties among the weights
    gen = torch.Generator().manual_seed(seed)
    s = (torch.randn(rows, vocab, generator=gen) * scale).bfloat16().float()
    return (s - s.amax(-1, keepdim=True)).exp()


@pytest.mark.parametrize("scale", [0.1, 1.0, 4.0, 30.0])  # flat rows (wide nuclei) to one-token ones
@pytest.mark.parametrize("vocab", [1, 7, 1000, 49152])
def test_matches_the_sorted_prefix(scale, vocab):
    w = _weights(16, vocab, scale, seed=vocab)
    w[:, 1::5] = 0  # tokens a filter removed
    w /= w.amax(-1, keepdim=True)  # each row's largest 1, as the sampler's
    gen = torch.Generator().manual_seed(1)
    top_p = torch.cat([torch.tensor([1.0, 1e-7, 0.999999, 0.5]), torch.rand(12, generator=gen)]).repeat(3)
    # none, then top-k alone or with top-p: 1, 50, the whole vocabulary, more than it
    top_k = torch.tensor([0] * 16 + [1, 50, vocab, vocab + 5] * 8, dtype=torch.int32)
    top_p[16:32] = 1.0
    w = w.repeat(3, 1)
    # min-p on every other row of the last third: alone, and under top-k and top-p
    min_p = torch.tensor([0.0] * 32 + [0.0, 0.05, 0.5, 0.9] * 4)
    want = reference_nucleus_threshold(w, min_p, top_k, top_p)
    kept = w.clone()
    tau = nucleus_threshold(kept, min_p, top_k, top_p)
    assert torch.equal(tau, want)
    assert tau[0] == 0  # top_p 1, no top_k, no min_p: every token
    assert torch.equal(kept, torch.where(w >= want[:, None], w, 0))  # the rest set to 0 in place


def test_the_nucleus_is_the_smallest_prefix_reaching_top_p_and_its_ties():
    # Masses 8, 4, 4, 2, 1, 1 of 20 (scaled so the largest is 1, as the sampler's weights)
    # and top_p and min_p values exact in binary: the boundaries are exact.
    w = torch.tensor([[2.0, 8.0, 4.0, 4.0, 1.0, 1.0]]) / 8
    def kept(p: float, k: int = 0, m: float = 0.0) -> set[int]:
        tau = nucleus_threshold(w.clone(), torch.tensor([m]), torch.tensor([k], dtype=torch.int32), torch.tensor([p]))
        return set(torch.nonzero(w[0] >= tau).flatten().tolist())

    for p, want in ((0.375, {1}), (0.5, {1, 2, 3}), (0.75, {1, 2, 3}), (0.8125, {0, 1, 2, 3}),
                    (0.9375, {0, 1, 2, 3, 4, 5})):
        assert kept(p) == want, p
    assert kept(1.0, 1) == {1} and kept(1.0, 2) == {1, 2, 3} and kept(1.0, 4) == {0, 1, 2, 3}  # ties at the k-th
    # top-p over what top-k kept: 0.9375 of the top 4's 18 needs all four, not the two
    # top-k dropped (0.9375 of the row's 20 would take them too); 0.625 of 16 is 8 + a tied 4
    assert kept(0.9375, 4) == {0, 1, 2, 3} and kept(0.75, 1) == {1} and kept(0.625, 3) == {1, 2, 3}
    # min-p keeps weights of at least min_p times the largest (its boundary included), first
    assert kept(1.0, m=0.25) == {0, 1, 2, 3} and kept(1.0, m=0.5) == {1, 2, 3} and kept(1.0, m=0.75) == {1}
    assert kept(1.0, 6, m=0.5) == {1, 2, 3} and kept(0.9375, m=0.25) == {0, 1, 2, 3}  # 0.9375 of 18: all 4


def test_reads_rows_with_a_stride():
    w = _weights(8, 300, 1.0, seed=3)
    wide = torch.cat([w, torch.ones(8, 50)], 1)
    top_p = torch.full((8,), 0.9)
    top_k, min_p = torch.tensor([0, 10] * 4, dtype=torch.int32), torch.tensor([0.0, 0.0, 0.1, 0.1] * 2)
    assert torch.equal(nucleus_threshold(wide[:, :300], min_p, top_k, top_p),
                       reference_nucleus_threshold(w, min_p, top_k, top_p))
    assert torch.equal(wide[:, 300:], torch.ones(8, 50))  # the columns past the view untouched


def test_launcher_refuses_what_the_kernel_cannot_read():
    none, zeros = torch.zeros(2, dtype=torch.int32), torch.zeros(2)
    with pytest.raises(AssertionError):
        nucleus_threshold(torch.ones(2, 5, dtype=torch.float64), zeros, none, torch.ones(2))
    with pytest.raises(AssertionError):
        nucleus_threshold(torch.ones(2, 5), zeros, none, torch.ones(3))
    with pytest.raises(AssertionError):
        nucleus_threshold(torch.ones(2, 5), zeros, none.long(), torch.ones(2))
