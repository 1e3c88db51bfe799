"""The batched sampler against per-row references: drawn distributions (chi-square on
fixed seeds), seeded draws whatever shares the batch, the block draw, logit_bias."""
from __future__ import annotations

import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from loraplex.engine.kernels.cpu import draw as cpu_draw
from loraplex.engine.kernels.cpu import nucleus as cpu_nucleus
from loraplex.engine.request import SamplingParams
from loraplex.engine.sampler import Sampler, SampleRow, draw
from tests.engine.test_sampler import PLAIN_DRAWS, _chi2, reference_probs, reference_process

_LOGITS = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 1.4, 0.7, -0.2, 0.9])
# Upper 1e-4 tail of chi-square by degrees of freedom (the support size minus one).
_CHI2_LIMIT = {1: 15.2, 2: 18.5, 3: 21.2, 4: 23.6, 5: 25.8, 6: 27.9, 7: 29.9, 8: 31.9, 9: 33.8}


# How top-p nuclei are found: a sort (every backend), or the "cpu" backend's threshold.
NUCLEI = [pytest.param(None, id="sort"),
          pytest.param(cpu_nucleus.nucleus_threshold, id="cpu_threshold",
                       marks=pytest.mark.skipif(cpu_nucleus.load_library() is None, reason="no C compiler"))]


def _counts(tokens: list[int], vocab: int) -> list[int]:
    return [tokens.count(i) for i in range(vocab)]


def _draw_many(params: SamplingParams, n: int, seeded: bool, nucleus=None) -> list[int]:
    rows = [SampleRow(params if not seeded else SamplingParams(**{**params.__dict__, "seed": s}), 0)
            for s in range(n)]
    tokens, _ = Sampler(seed=5, nucleus=nucleus).sample(_LOGITS.expand(n, -1).contiguous(), rows)
    return tokens


@pytest.mark.parametrize("kw", [dict(temperature=1.3, top_k=3), dict(temperature=0.7, top_p=0.8),
                                dict(min_p=0.15), dict(temperature=1.5, top_k=6, top_p=0.9, min_p=0.05),
                                dict(temperature=2.0, top_p=0.97)])
@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("nucleus", NUCLEI)
def test_filtered_distributions_match_the_per_row_reference(kw, seeded, nucleus):
    params = SamplingParams(**kw)
    want = reference_probs(_LOGITS, params).float()
    n = 8000
    tokens = _draw_many(params, n, seeded, nucleus)
    support = [i for i, p in enumerate(want.tolist()) if p > 0]
    assert set(tokens) == set(support)  # every kept token shows at these masses, no dropped one does
    counts = [_counts(tokens, len(_LOGITS))[i] for i in support]
    assert _chi2(counts, want[support]) < _CHI2_LIMIT[len(support) - 1], (counts, (want[support] * n).tolist())
    # ...and the test can tell: the same support at another temperature fails.
    wrong = torch.softmax(_LOGITS / (params.temperature * 1.5), -1)[support]
    assert _chi2(counts, wrong / wrong.sum()) > 60


@pytest.mark.parametrize("nucleus", NUCLEI)
def test_top_p_nucleus_wider_than_the_partial_sort_is_drawn_from_whole(nucleus):
    vocab = 3000  # flat logits: the 0.9 nucleus holds ~2700 tokens
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 0.3
    params = SamplingParams(top_p=0.9)
    support = set(torch.nonzero(reference_probs(logits, params) > 0).flatten().tolist())
    assert 2000 < len(support) < vocab
    n = 3000
    rows = [SampleRow(SamplingParams(top_p=0.9, seed=s), 0) for s in range(n)]
    tokens, _ = Sampler(nucleus=nucleus).sample(logits.expand(n, -1).contiguous(), rows)
    assert set(tokens) <= support
    ranks = torch.argsort(torch.argsort(logits, descending=True))
    assert max(int(ranks[t]) for t in tokens) > 1500, "draws reach deep into the nucleus"


_KINDS = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.2, top_k=20),
          dict(min_p=0.1), dict(temperature=0.9, top_k=40, top_p=0.8, min_p=0.02),
          dict(temperature=1.0, logit_bias={3: 2.0, 17: -5.0}), dict(temperature=1.1, repetition_penalty=1.3)]


@pytest.mark.parametrize("kind", range(len(_KINDS)))
@pytest.mark.parametrize("nucleus", NUCLEI)
@pytest.mark.parametrize("plain_draw", PLAIN_DRAWS)
def test_seeded_request_draws_the_same_alone_and_in_any_mixed_batch(kind, nucleus, plain_draw):
    vocab = 500
    gen = torch.Generator().manual_seed(kind)
    target_logits = torch.randn(vocab, generator=gen) * 2
    others = [SampleRow(SamplingParams(**{**_KINDS[j], "seed": None if j % 2 else 100 + j}), j, [1, 2], [3])
              for j in range(len(_KINDS))] + [SampleRow(SamplingParams(temperature=0), 0)]
    other_logits = torch.randn(len(others), vocab, generator=gen) * 2
    rng = random.Random(kind)
    for index in (0, 1, 7, 300):
        target = SampleRow(SamplingParams(seed=42, **_KINDS[kind]), index, [5, 6], [7, 7])
        alone, _ = Sampler(seed=1, nucleus=nucleus, plain_draw=plain_draw).sample(target_logits[None].clone(), [target])
        for trial in range(4):
            chosen = rng.sample(range(len(others)), rng.randint(1, len(others)))
            pos = rng.randint(0, len(chosen))
            rows = [others[j] for j in chosen]
            rows.insert(pos, target)
            logits = torch.cat([other_logits[chosen[:pos]], target_logits[None], other_logits[chosen[pos:]]])
            tokens, _ = Sampler(seed=trial + 10, nucleus=nucleus, plain_draw=plain_draw).sample(logits, rows)
            assert tokens[pos] == alone[0], (index, chosen, pos)


def test_draw_follows_the_weights_across_blocks_and_never_picks_a_zero():
    vocab = 700  # blocks of 256: the last one partial
    picks = {3: 1.0, 255: 2.0, 256: 3.0, 511: 1.5, 699: 2.5}
    w = torch.zeros(vocab)
    w[list(picks)] = torch.tensor(list(picks.values()))
    n, gen = 8000, torch.Generator().manual_seed(3)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    keys = torch.randint(0, 2 ** 32, (n,), generator=gen)
    tokens = draw(w.expand(n, -1), u, keys).tolist()
    assert set(tokens) == set(picks)
    want = torch.tensor(list(picks.values())) / sum(picks.values())
    assert _chi2([tokens.count(t) for t in picks], want) < _CHI2_LIMIT[4]
    # Within a block the noise decides: every token of a flat block shows.
    flat = torch.zeros(n, vocab)
    flat[:, 256:512] = 1.0
    assert set(draw(flat, u, keys).tolist()) == set(range(256, 512))
    for edge in (0.0, 1 - 2 ** -53):
        got = draw(w.expand(4, -1), torch.full((4,), edge, dtype=torch.float64), keys[:4])
        assert all(t in picks for t in got.tolist()), edge


def test_logit_bias_applied_batched_equals_the_per_row_reference():
    vocab = 300
    gen = torch.Generator().manual_seed(4)
    shared = SamplingParams(temperature=0, logit_bias={i: (-1) ** i * 0.3 * i for i in range(0, 300, 7)})
    kinds = [shared, SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={299: 100, 0: -100}),
             shared, SamplingParams(temperature=0, logit_bias={5: 1.5}, presence_penalty=0.5),
             SamplingParams(temperature=0, logit_bias={t: 0.01 for t in range(vocab)})]
    sampler = Sampler()
    for step in range(4):  # the same requests over steps, then a changed set of rows
        params = kinds if step < 3 else kinds[::-1][:4] + [SamplingParams(temperature=0, logit_bias={9: 3.0})]
        rows = [SampleRow(p, step, [1], [2, 2]) for p in params]
        logits = torch.randn(len(rows), vocab, generator=gen)
        want = torch.stack([reference_process(logits[i], [1], [2, 2], p.presence_penalty, p.frequency_penalty,
                                              p.repetition_penalty, dict(p.logit_bias)) for i, p in enumerate(params)])
        torch.testing.assert_close(sampler.process(logits, rows), want, rtol=0, atol=1e-5)


_METADATA = {"__len__", "__get__", "size", "dim"}


class _TorchCalls(TorchFunctionMode):
    """Counts the torch functions and Tensor methods called while it is active (by name),
    so a per-row Python loop shows as calls that grow with the rows. Reads of a tensor's
    length or attributes (shape, device) launch no operation and are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", repr(func))
        if name not in _METADATA:
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_logit_bias_of_many_rows_is_applied_in_a_constant_number_of_tensor_calls():
    """A step applies every row's logit_bias in one indexed accumulate: 64 rows of 250
    entries each take the very same torch calls as one row (a request's bias tensors are
    built on its first step and reused after)."""
    vocab, entries = 1000, 250
    gen = torch.Generator().manual_seed(9)

    def step_calls(n: int) -> dict[str, int]:
        params = [SamplingParams(temperature=0, logit_bias={t: 0.01 * (r + 1) for t in
                                                            torch.randperm(vocab, generator=gen)[:entries].tolist()})
                  for r in range(n)]
        rows = [SampleRow(p, 0) for p in params]
        sampler = Sampler()
        sampler.process(torch.zeros(n, vocab), rows)  # the first step builds each request's tensors once
        logits = torch.randn(n, vocab, generator=gen)
        with _TorchCalls() as counter:
            got = sampler.process(logits, rows)
        want = torch.stack([reference_process(logits[i], [], [], bias=dict(p.logit_bias))
                            for i, p in enumerate(params)])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        return counter.calls

    one, many = step_calls(1), step_calls(64)
    assert many.get("index_put_") == 1, many
    assert many == one, (one, many)


@pytest.mark.skipif(cpu_draw.load_library() is None, reason="no C compiler")
def test_plain_rows_are_drawn_from_the_raw_logits_as_torch_draws_them_widened():
    vocab = 49152
    logits = (torch.randn(8, vocab, generator=torch.Generator().manual_seed(3)) * 3).bfloat16()
    plain = [SampleRow(SamplingParams(temperature=0), 0), SampleRow(SamplingParams(seed=1), 4),
             SampleRow(SamplingParams(seed=2, temperature=0.6), 9), SampleRow(SamplingParams(seed=3, top_k=vocab), 1)]
    other = [SampleRow(SamplingParams(seed=4, top_p=0.9), 2), SampleRow(SamplingParams(seed=5, logprobs=2), 3),
             SampleRow(SamplingParams(seed=6, logit_bias={7: 5.0}), 0),
             SampleRow(SamplingParams(temperature=0, repetition_penalty=1.3), 0, [1, 2], [3])]
    calls = []

    def counted(x, *args):
        calls.append((x.dtype, x.shape[0]))
        return cpu_draw.plain_draw(x, *args)

    for rows in (plain, [other[0], plain[0], other[1], plain[1], other[2], plain[2], other[3], plain[3]]):
        batch = logits[:len(rows)]
        calls.clear()
        got = Sampler(seed=9, plain_draw=counted).sample(batch, rows)
        assert got == Sampler(seed=9).sample(batch.float(), rows)
        assert calls == [(torch.bfloat16, len(plain))], "the plain rows, unwidened, in one call"
