"""Sampler unit tests on hand-made logits; penalties also end to end on the tiny llama."""
from __future__ import annotations

import math

import pytest
import torch

from loraplex.engine.kernels.cpu import draw as cpu_draw
from loraplex.engine.request import SamplingParams
from loraplex.engine.sampler import Sampler, SampleRow, greedy_tokens

# How greedy and temperature-only rows are drawn: by torch (every backend), or by the
# "cpu" backend's kernel from the raw logits.
PLAIN_DRAWS = [pytest.param(None, id="torch"),
               pytest.param(cpu_draw.plain_draw, id="cpu_draw",
                            marks=pytest.mark.skipif(cpu_draw.load_library() is None, reason="no C compiler"))]


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The per-row reference: top-k by the k-th value, then the smallest prefix of the
    sorted renormalized distribution whose mass reaches top_p (always the top token)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, idx, sorted_logits)
    return logits


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution one row is drawn from, computed row by row the plain way:
    temperature, min-p (p < min_p * p_max dropped), top-k, top-p."""
    lg = logits.double() / params.temperature
    if params.min_p > 0:
        probs = torch.softmax(lg, -1)
        lg = lg.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return torch.softmax(_filter_top_k_top_p(lg, params.top_k, params.top_p), -1)


def _row(output_index: int = 0, **kw) -> SampleRow:
    return SampleRow(SamplingParams(**kw), output_index)


def _logits(n_rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _draw(logits_row: torch.Tensor, n: int, plain_draw=None, **kw) -> list[int]:
    """n samples of one distribution, each with its own seed (one batch of n rows)."""
    rows = [_row(0, seed=s, **kw) for s in range(n)]
    tokens, _ = Sampler(plain_draw=plain_draw).sample(logits_row.expand(n, -1).contiguous(), rows)
    return tokens


# -- greedy --------------------------------------------------------------------------
@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0, top_k=1),
                                    dict(temperature=0.0, seed=3, top_p=0.5), dict(temperature=1e-40)])
@pytest.mark.parametrize("plain_draw", PLAIN_DRAWS)
def test_greedy_is_argmax(params, plain_draw):
    logits = _logits(8, 100)
    tokens, logprobs = Sampler(plain_draw=plain_draw).sample(logits, [_row(i, **params) for i in range(8)])
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs == [None] * 8


@pytest.mark.parametrize("plain_draw", PLAIN_DRAWS)
def test_greedy_rows_beside_sampled_rows_stay_argmax(plain_draw):
    logits = _logits(6, 50)
    rows = [_row(0, temperature=0) if i % 2 == 0 else _row(0, temperature=2.0, seed=i) for i in range(6)]
    tokens, _ = Sampler(plain_draw=plain_draw).sample(logits, rows)
    assert tokens[::2] == logits[::2].argmax(-1).tolist()


# -- top-k / top-p support --------------------------------------------------------------
def test_top_k_restricts_support():
    logits = _logits(1, 64, seed=5)[0]
    top5 = set(torch.topk(logits, 5).indices.tolist())
    # High temperature flattens the distribution, so sampling outside top-k would show.
    seen = set(_draw(logits, 600, temperature=5.0, top_k=5))
    assert seen <= top5
    assert seen == top5, "every top-k token should appear at this temperature"


def test_top_k_larger_than_vocab_is_no_filter():
    logits = torch.zeros(10)
    assert torch.equal(_filter_top_k_top_p(logits, 50, 1.0), logits)
    assert len(set(_draw(logits, 400, top_k=50))) == 10


# Probabilities 0.4, 0.3, 0.2, 0.1 placed in a scrambled vocab order so the sort matters.
_PROBS = {7: 0.4, 2: 0.3, 9: 0.2, 4: 0.1}


def _crafted(vocab: int = 12) -> torch.Tensor:
    logits = torch.full((vocab,), -1e4)  # the other tokens: probability ~0
    for tok, p in _PROBS.items():
        logits[tok] = math.log(p)
    return logits


@pytest.mark.parametrize("top_p,support", [
    (0.35, {7}),            # the top token alone reaches 0.35
    (0.45, {7, 2}),         # 0.4 < 0.45 <= 0.7
    (0.65, {7, 2}),
    (0.75, {7, 2, 9}),      # 0.7 < 0.75 <= 0.9
    (0.95, {7, 2, 9, 4}),
    (1.0, set(range(12))),  # no filtering: every token keeps a (tiny) probability
])
def test_top_p_keeps_smallest_set_reaching_p(top_p, support):
    filtered = _filter_top_k_top_p(_crafted(), 0, top_p)
    assert {i for i, v in enumerate(filtered.tolist()) if v != float("-inf")} == support
    if top_p < 1.0:
        # Sampling sees exactly that support (each kept token has >= 10% renormalized mass).
        assert set(_draw(_crafted(), 400, top_p=top_p)) == support


def test_top_k_and_top_p_combine():
    # top_k=2 leaves {7: 0.4, 2: 0.3} -> renormalized 0.571, 0.429; top_p=0.5 keeps only 7.
    assert set(_draw(_crafted(), 200, top_k=2, top_p=0.5)) == {7}
    assert set(_draw(_crafted(), 200, top_k=3, top_p=0.99)) == {7, 2, 9}


def test_top_p_with_temperature_applies_after_scaling():
    # At temperature 0.5 the probabilities sharpen to 16:9:4:1 (/30): 0.533, 0.3, ...
    # top_p=0.5 then keeps only token 7; at temperature 1 it would keep 7 and 2.
    assert set(_draw(_crafted(), 200, temperature=0.5, top_p=0.5)) == {7}
    assert set(_draw(_crafted(), 200, temperature=1.0, top_p=0.5)) == {7, 2}


# -- the sampled distribution ---------------------------------------------------------------
def _chi2(counts: list[int], probs: torch.Tensor) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs.tolist()))


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("plain_draw", PLAIN_DRAWS)
def test_sampled_distribution_matches_softmax(temperature, seeded, plain_draw):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5])
    n = 6000
    if seeded:
        tokens = _draw(logits, n, plain_draw, temperature=temperature)
    else:
        rows = [_row(0, temperature=temperature) for _ in range(n)]
        tokens, _ = Sampler(seed=123, plain_draw=plain_draw).sample(logits.expand(n, -1).contiguous(), rows)
    counts = [tokens.count(i) for i in range(6)]
    expected = torch.softmax(logits / temperature, -1)
    # 5 degrees of freedom: chi2 > 25 has p ~ 1e-4. Fixed seeds make it deterministic.
    assert _chi2(counts, expected) < 25, (counts, (expected * n).tolist())
    # ...and the test can tell: the untempered (or wrongly tempered) distribution fails.
    wrong = torch.softmax(logits / (temperature * 1.5), -1)
    assert _chi2(counts, wrong) > 60


@pytest.mark.parametrize("plain_draw", PLAIN_DRAWS)
def test_unseeded_rows_use_the_sampler_generator(plain_draw):
    logits = torch.zeros(4, 1000)
    rows = [_row(0) for _ in range(4)]
    a, _ = Sampler(seed=1, plain_draw=plain_draw).sample(logits, rows)
    b, _ = Sampler(seed=1, plain_draw=plain_draw).sample(logits, rows)
    assert a == b, "the engine seed makes unseeded sampling reproducible per engine"
    assert len(set(a)) > 1, "rows of one batch draw independent noise"


# -- per-request seeds -------------------------------------------------------------------------
@pytest.mark.parametrize("plain_draw", PLAIN_DRAWS)
def test_seeded_token_independent_of_batch_composition_and_order(plain_draw):
    vocab = 1000
    flat = torch.zeros(vocab)  # uniform: the token is decided by the noise alone
    target = _row(3, seed=7, temperature=1.0)
    alone, _ = Sampler(seed=0, plain_draw=plain_draw).sample(flat[None], [target])

    others = [_row(0), _row(5, seed=9), _row(3, seed=8, top_k=10), _row(0, temperature=0)]
    other_logits = _logits(len(others), vocab, seed=11)
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0], []):
        for pos in range(len(order) + 1):
            rows = [others[i] for i in order]
            logit_rows = [other_logits[i] for i in order]
            rows.insert(pos, target)
            logit_rows.insert(pos, flat)
            # A different engine seed and a used generator must not matter either.
            sampler = Sampler(seed=pos + 100, plain_draw=plain_draw)
            sampler.sample(_logits(2, vocab), [_row(0), _row(0)])
            tokens, _ = sampler.sample(torch.stack(logit_rows), rows)
            assert tokens[pos] == alone[0], (order, pos)


@pytest.mark.parametrize("plain_draw", PLAIN_DRAWS)
def test_seeds_and_output_indices_change_the_draw(plain_draw):
    flat = torch.zeros(1, 1000)
    by_seed = {s: Sampler(plain_draw=plain_draw).sample(flat, [_row(0, seed=s)])[0][0] for s in range(20)}
    assert len(set(by_seed.values())) >= 15, by_seed
    by_index = {i: Sampler(plain_draw=plain_draw).sample(flat, [_row(i, seed=7)])[0][0] for i in range(20)}
    assert len(set(by_index.values())) >= 15, by_index
    # Same (seed, index) twice in one batch: the same token.
    tokens, _ = Sampler(plain_draw=plain_draw).sample(flat.expand(2, -1), [_row(4, seed=7), _row(4, seed=7)])
    assert tokens[0] == tokens[1] == by_index[4]


@pytest.mark.parametrize("plain_draw", PLAIN_DRAWS)
def test_negative_and_huge_seeds_work(plain_draw):
    flat = torch.zeros(1, 1000)
    for seed in (-1, -(2 ** 70), 2 ** 64 + 5, 0):
        a, _ = Sampler(plain_draw=plain_draw).sample(flat, [_row(0, seed=seed)])
        b, _ = Sampler(plain_draw=plain_draw).sample(flat, [_row(0, seed=seed)])
        assert a == b


# -- logprobs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=0.5, top_k=3, seed=1),
                                    dict(temperature=1.3, top_p=0.8, seed=2)])
def test_logprobs_are_of_the_raw_logits(params):
    logits = _logits(3, 40, seed=2)
    rows = [_row(i, logprobs=5, **params) for i in range(3)]
    tokens, logprobs = Sampler().sample(logits, rows)
    ref = torch.log_softmax(logits.double(), -1)
    for i, (tok, lp) in enumerate(zip(tokens, logprobs)):
        chosen, top = lp
        assert chosen == pytest.approx(float(ref[i, tok]), abs=1e-5)
        assert len(top) == 5
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        want = torch.topk(ref[i], 5)
        assert [t for t, _ in top] == want.indices.tolist()
        assert values == pytest.approx(want.values.tolist(), abs=1e-5)
        assert all(isinstance(t, int) and isinstance(v, float) for t, v in top)
        if params.get("temperature") == 0:
            assert top[0][0] == tok and top[0][1] == pytest.approx(chosen)


def test_logprobs_zero_gives_only_the_chosen_token():
    logits = _logits(2, 30, seed=4)
    rows = [_row(0, temperature=0, logprobs=0), _row(0, temperature=0)]
    tokens, logprobs = Sampler().sample(logits, rows)
    chosen, top = logprobs[0]
    assert top == []
    assert chosen == pytest.approx(float(torch.log_softmax(logits[0], -1)[tokens[0]]), abs=1e-6)
    assert logprobs[1] is None


def test_logprobs_only_for_rows_that_ask():
    logits = _logits(4, 30, seed=6)
    rows = [_row(0, temperature=0), _row(0, temperature=0, logprobs=2), _row(0, temperature=0),
            _row(0, temperature=0, logprobs=20)]
    tokens, logprobs = Sampler().sample(logits, rows)
    assert logprobs[0] is None and logprobs[2] is None
    assert len(logprobs[1][1]) == 2 and len(logprobs[3][1]) == 20
    assert logprobs[3][0] == pytest.approx(float(torch.log_softmax(logits[3], -1)[tokens[3]]), abs=1e-6)


# -- penalties and logit_bias (vLLM's formula) --------------------------------------------------
def reference_process(logits: torch.Tensor, prompt: list[int], output: list[int], presence: float = 0.0,
                      frequency: float = 0.0, repetition: float = 1.0, bias: dict[int, float] | None = None
                      ) -> torch.Tensor:
    """vLLM, token by token: logit_bias, then repetition over prompt + output (divide a
    positive logit, multiply a negative one), then frequency x count and presence over the output."""
    out = logits.clone()
    for tok, b in (bias or {}).items():
        out[tok] += b
    for tok in set(prompt) | set(output):
        out[tok] = out[tok] / repetition if out[tok] > 0 else out[tok] * repetition
    for tok in set(output):
        out[tok] -= frequency * output.count(tok) + presence
    return out


def _ids(rng: torch.Generator, n: int, vocab: int) -> list[int]:
    # Few distinct ids, so tokens repeat and counts above one occur.
    return torch.randint(0, min(vocab, 12), (n,), generator=rng).tolist()


_PENALTY_CASES = [dict(presence_penalty=0.7), dict(frequency_penalty=0.4), dict(repetition_penalty=1.6),
                  dict(repetition_penalty=0.6), dict(presence_penalty=-1.5, frequency_penalty=2.0, repetition_penalty=1.3),
                  dict(logit_bias={3: 5.0, "7": -100, 11: 0.25}),
                  dict(logit_bias={1: 2.0}, frequency_penalty=-0.5, repetition_penalty=1.1)]


def test_penalties_and_logit_bias_match_the_reference_formula():
    vocab, rng = 40, torch.Generator().manual_seed(3)
    logits = _logits(len(_PENALTY_CASES), vocab, seed=8)
    rows, want = [], []
    for i, kw in enumerate(_PENALTY_CASES):
        prompt, output = _ids(rng, 9, vocab), _ids(rng, i * 3, vocab)  # row 0: no output yet
        rows.append(SampleRow(SamplingParams(temperature=0, **kw), len(output), prompt, output))
        p = rows[-1].params
        want.append(reference_process(logits[i], prompt, output, p.presence_penalty, p.frequency_penalty,
                                      p.repetition_penalty, dict(p.logit_bias)))
    got = Sampler().process(logits, rows)
    torch.testing.assert_close(got, torch.stack(want), rtol=0, atol=1e-5)
    tokens, _ = Sampler().sample(logits, rows)
    assert tokens == torch.stack(want).argmax(-1).tolist()


@pytest.mark.parametrize("plain_draw", PLAIN_DRAWS)
def test_rows_without_processors_are_bit_identical_in_a_mixed_batch(plain_draw):
    vocab = 64
    logits = _logits(6, vocab, seed=9)
    plain = [_row(0, temperature=0), _row(2, seed=5, temperature=0.9), _row(1, seed=6, top_k=8)]
    fancy = [SampleRow(SamplingParams(temperature=0, repetition_penalty=1.8, presence_penalty=1.0), 3,
                       [1, 2, 3], [4, 4, 5]),
             SampleRow(SamplingParams(seed=1, logit_bias={0: 100}), 0),
             SampleRow(SamplingParams(temperature=0.5, seed=2, frequency_penalty=1.2, min_p=0.2), 2, [7], [7, 7])]
    rows = [plain[0], fancy[0], plain[1], fancy[1], plain[2], fancy[2]]
    processed = Sampler(plain_draw=plain_draw).process(logits, rows)
    for i in (0, 2, 4):
        assert torch.equal(processed[i], logits[i])
    assert not torch.equal(processed[1], logits[1])
    mixed, _ = Sampler(plain_draw=plain_draw).sample(logits, rows)
    alone, _ = Sampler(plain_draw=plain_draw).sample(logits[[0, 2, 4]], plain)
    assert mixed[0::2] == alone
    assert mixed[3] == 0  # a +100 bias wins any draw from these logits


def test_no_processor_means_no_copy():
    logits = _logits(3, 20)
    rows = [_row(0), _row(0, temperature=0), _row(1, seed=3, min_p=0.1)]
    assert Sampler().process(logits, rows) is logits


def test_logprobs_stay_those_of_the_raw_logits():
    logits = _logits(1, 30, seed=12)
    row = SampleRow(SamplingParams(temperature=0, logprobs=3, logit_bias={5: 50}), 0)
    tokens, logprobs = Sampler().sample(logits, [row])
    assert tokens == [5]
    assert logprobs[0][0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[5]), abs=1e-6)


def test_min_p_keeps_tokens_within_the_ratio_of_the_top():
    # Probabilities 0.4, 0.3, 0.2, 0.1: min_p=0.6 keeps p >= 0.24 -> {7, 2}; 0.4 keeps p >= 0.16 -> {7, 2, 9}.
    assert set(_draw(_crafted(), 300, min_p=0.6)) == {7, 2}
    assert set(_draw(_crafted(), 300, min_p=0.4)) == {7, 2, 9}
    assert set(_draw(_crafted(), 300, min_p=0.3, temperature=0.5)) == {7, 2}  # after temperature: 16:9:4:1


@pytest.mark.parametrize("kw,message", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(logit_bias={1: 101}), "between -100 and 100"),
    (dict(logit_bias={"x": 1}), "token ids"), (dict(logit_bias={-1: 1}), "token ids"),
    (dict(logit_bias={1: "a"}), "between -100 and 100"), (dict(logit_bias=[1, 2]), "logit_bias"),
])
def test_bad_processor_params_are_refused(kw, message):
    from loraplex.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kw)


def test_logit_bias_is_normalized_and_checked_against_the_vocabulary():
    from loraplex.engine.errors import InvalidRequestError

    p = SamplingParams(logit_bias={"12": 1, 3: -2.5})
    assert p.logit_bias == ((3, -2.5), (12, 1.0))
    p.check_vocab(13)
    with pytest.raises(InvalidRequestError, match="vocabulary size 12"):
        p.check_vocab(12)


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama_dir):
    """The engine and transformers' model on the same tiny checkpoint."""
    from transformers import AutoModelForCausalLM

    from loraplex.engine.config import EngineConfig, ModelConfig
    from loraplex.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32")))
    return engine, AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
                                dict(repetition_penalty=0.8, logit_bias={100: 3.0, 200: -5.0}),
                                dict(frequency_penalty=1.5, logit_bias={"300": 1.0})])
def test_penalties_on_the_tiny_model_match_a_torch_reference(tiny_pair, kw):
    engine, model = tiny_pair
    prompts = [[5, 900, 17, 900, 4000, 17], [1200, 33, 33, 33]]
    n = 24
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)
    got = [o.new_token_ids for o in engine.generate(prompts, params)]
    for prompt, tokens in zip(prompts, got):
        out: list[int] = []
        with torch.inference_mode():
            for _ in range(n):
                logits = model(torch.tensor([prompt + out])).logits[0, -1]
                out.append(int(reference_process(logits, prompt, out, params.presence_penalty, params.frequency_penalty,
                                                 params.repetition_penalty, dict(params.logit_bias)).argmax()))
        assert tokens == out
    plain = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    assert [o.new_token_ids for o in plain] != got  # the penalties changed something here


def test_greedy_tokens_take_the_first_of_tied_maxima_as_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (16, 1000), generator=gen).float()  # many ties per row
    logits[3, 500] = float("nan")
    logits[5] = float("-inf")
    logits[7, 0] = logits[7, 999] = 100.0
    assert greedy_tokens(logits).tolist() == logits.argmax(-1).tolist()
    assert greedy_tokens(logits)[7] == 0 and greedy_tokens(logits)[5] == 0
