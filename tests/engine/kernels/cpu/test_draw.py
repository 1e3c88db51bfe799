"""The C plain draw (draw.c) against its reference, the sampler's torch path on the
widened logits."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels.cpu import draw
from loraplex.engine.kernels.cpu.draw import load_library, plain_draw, reference_plain_draw
from tests.engine.kernels.kernel_cases import use_build

pytestmark = pytest.mark.skipif(load_library() is None, reason="no C compiler to build the CPU kernel")

_SIGNATURES = {name: draw._ARGTYPES for name in draw._NAMES.values()}


@pytest.fixture(params=["native", "skylake-avx512", "x86-64-v3"])
def code_path(request, monkeypatch) -> str:
    """The kernel built for this CPU, and its AVX-512 and AVX2 (scalar loops) builds."""
    use_build(monkeypatch, draw, "draw.c", _SIGNATURES, request.param)
    return request.param


def _inputs(rows: int, vocab: int, dtype: torch.dtype, temperatures: list[float], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    temperature = torch.tensor((temperatures * rows)[:rows], dtype=torch.float32)
    u = torch.rand(rows, generator=gen, dtype=torch.float64)
    keys = torch.randint(0, 2 ** 32, (rows,), generator=gen)
    return logits, temperature, u, keys


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 7, 16, 300, 1000, 49152])  # under one vector, whole vectors, tails, blocks
def test_draws_the_reference_tokens(dtype, vocab, code_path):
    # greedy, the client's default, hotter and colder, the greedy bound, and near-uniform
    args = _inputs(96, vocab, dtype, [0.0, 1.0, 0.5, 2.0, 1e-5, 100.0])
    got = plain_draw(*args)
    assert torch.equal(got, reference_plain_draw(*args))
    assert ((got >= 0) & (got < vocab)).all()


def test_the_test_can_tell_a_draw_from_the_greedy_token():
    logits, temperature, u, keys = _inputs(64, 1000, torch.bfloat16, [1.0])
    logits = logits / 3  # flat enough that draws leave the top token
    drawn = plain_draw(logits, temperature, u, keys)
    assert (drawn != logits.float().argmax(-1)).sum() > 32
    assert not torch.equal(plain_draw(logits, temperature, torch.rand(64, dtype=torch.float64), keys), drawn)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_takes_the_first_of_tied_maxima(dtype, code_path):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (16, 1000), generator=gen).to(dtype)  # many ties per row
    logits[7, 0] = logits[7, 999] = 100.0
    logits[9, 998] = logits[9, 999] = 100.0  # the tie in the scalar tail
    zeros = torch.zeros(16)
    got = plain_draw(logits, zeros, torch.zeros(16, dtype=torch.float64), torch.zeros(16, dtype=torch.int64))
    assert got.tolist() == logits.float().argmax(-1).tolist()
    assert got[7] == 0 and got[9] == 998


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_with_nan_or_inf_gives_the_token_torch_max_gives(temperature, code_path):
    logits = torch.zeros(4, 1000)
    logits[0, 500] = float("nan")  # torch's max propagates the NaN: its index
    logits[1, 3] = logits[1, 997] = float("nan")
    logits[2, 998] = float("nan")  # in the scalar tail
    logits[3, 40] = float("inf")
    got = plain_draw(logits, torch.full((4,), temperature), torch.rand(4, dtype=torch.float64),
                     torch.zeros(4, dtype=torch.int64))
    assert got.tolist() == [500, 3, 998, 40]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_token_with_a_minus_inf_logit_is_never_drawn(dtype, code_path):
    rows, vocab = 256, 1000
    logits = torch.full((rows, vocab), float("-inf"), dtype=dtype)
    logits[:, 250:262] = 0.0  # two blocks, a few live tokens each: the race meets -inf neighbours
    logits[:, 999] = -120.0  # far below fp32 exp's range: weight 0, as torch's exp gives it
    got = plain_draw(logits, torch.ones(rows), torch.rand(rows, generator=torch.Generator().manual_seed(1),
                                                         dtype=torch.float64),
                     torch.randint(0, 2 ** 32, (rows,), generator=torch.Generator().manual_seed(2)))
    assert set(got.tolist()) == set(range(250, 262))


def test_one_thread_and_two_draw_the_same():
    args = _inputs(64, 4096, torch.bfloat16, [1.0, 0.7, 0.0])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = plain_draw(*args)
        torch.set_num_threads(2)
        two = plain_draw(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_the_launcher_checks_its_arguments():
    logits, temperature, u, keys = _inputs(4, 100, torch.bfloat16, [1.0])
    with pytest.raises(AssertionError):
        plain_draw(logits.half(), temperature, u, keys)
    with pytest.raises(AssertionError):
        plain_draw(logits, temperature.double(), u, keys)
    with pytest.raises(AssertionError):
        plain_draw(logits, temperature, u[:3], keys)
    with pytest.raises(AssertionError):
        plain_draw(logits.t(), temperature, u, keys)
    assert plain_draw(logits[:0], temperature[:0], u[:0], keys[:0]).shape == (0,)
