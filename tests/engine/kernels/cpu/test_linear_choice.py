"""The bf16 linear each row count gets on this CPU: the measured crossover between the C
kernel and the fastest oneDNN kernel, and the split layer that follows it."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels.cpu import gemm, linear_choice as lc
from loraplex.engine.kernels.cpu.backend import c_linear
from loraplex.engine.kernels.torch.linear import PackedLinear, WideLinear, packing_supported, widening_supported

CPU = torch.device("cpu")
FEW = c_linear()
MANY = [m for m, ok in ((PackedLinear, packing_supported(CPU, torch.bfloat16)),
                        (WideLinear, widening_supported(CPU, torch.bfloat16))) if ok]
both = pytest.mark.skipif(not (gemm.load_library() and MANY), reason="needs a C bf16 kernel and a oneDNN one")


def test_onednn_takes_over_only_where_it_is_clearly_faster_from_there_on():
    amx_like = {1: (1.0, 1.5), 4: (1.2, 1.3), 8: (2.0, 1.0), 16: (4.0, 1.0), 64: (16.0, 1.5)}
    assert lc.crossover(amx_like) == 8
    epyc_like = {1: (1.0, 2.0), 16: (2.0, 2.2), 64: (8.0, 7.5), 128: (16.0, 15.0)}  # faster, within noise
    assert lc.crossover(epyc_like) is None
    # a win below a loss does not count: from 16 rows on it must win everywhere
    assert lc.crossover({1: (1.0, 0.5), 4: (1.0, 2.0), 16: (4.0, 1.0), 64: (16.0, 2.0)}) == 16
    assert lc.crossover({1: (2.0, 1.0), 64: (9.0, 1.0)}) == 1  # oneDNN everywhere


def test_a_choice_makes_the_kernel_for_each_side_of_its_crossover():
    w = torch.randn(40, 24).bfloat16()
    assert lc.LinearChoice(gemm.Bf16Linear, WideLinear, None).make() is gemm.Bf16Linear
    if MANY:
        many = MANY[-1]
        assert lc.LinearChoice(gemm.Bf16Linear, many, 1).make() is many
        split = lc.LinearChoice(gemm.Bf16Linear, many, 16).make()(w, None)
        assert type(split) is lc.SplitLinear and split.from_rows == 16
        assert type(split.few) is gemm.Bf16Linear and type(split.many) is many


def test_the_fastest_onednn_kernel_at_the_most_rows_serves_from_its_crossover_with_the_c_kernel():
    few, packed, wide = "C", "packed", "wide"  # decide() only passes them through
    # rows -> (C, packed bf16, widened fp32) seconds: emulated bf16, as on a Xeon without bf16
    emulated = {1: (1.0, 1.2, 1.6), 16: (3.0, 5.9, 3.0), 64: (10.0, 17.0, 6.3), 128: (19.0, 32.0, 10.7)}
    assert lc.decide(few, [packed, wide], emulated) == lc.LinearChoice(few, wide, 64)
    # AMX: packed bf16 wins at the most rows, from 16 on
    amx = {1: (1.0, 1.5, 1.6), 16: (4.0, 1.0, 2.0), 128: (30.0, 3.0, 12.0)}
    assert lc.decide(few, [packed, wide], amx) == lc.LinearChoice(few, packed, 16)
    # the fastest oneDNN kernel not clearly faster than C: C everywhere
    assert lc.decide(few, [wide], {1: (1.0, 2.0), 128: (10.0, 9.0)}).from_rows is None


@both
def test_measure_times_every_kernel_at_every_row_count():
    times = lc.measure([FEW, *MANY], rows=(1, 4), reps=1)
    assert sorted(times) == [1, 4]
    assert all(len(t) == 1 + len(MANY) and all(x > 0 for x in t) for t in times.values())


@both
def test_the_measured_choice_is_a_measured_row_count_and_kept_per_thread_count():
    choice = lc.choose(FEW, MANY)
    assert choice.few is FEW and choice.many in MANY
    assert choice.from_rows is None or choice.from_rows in lc.ROWS
    assert lc.choose(FEW, MANY) is choice  # measured once
    layer = choice.make()(torch.randn(40, 24).bfloat16(), None)
    expected = {None: FEW, 1: choice.many}.get(choice.from_rows, lc.SplitLinear)
    assert type(layer) is expected


@both
@pytest.mark.parametrize("many", MANY)
@pytest.mark.parametrize("bias", [False, True])
def test_the_split_layer_is_each_kernel_on_its_side_of_the_crossover(bias, many):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(72, 40, generator=gen).bfloat16()
    b = torch.randn(72, generator=gen).bfloat16() if bias else None
    split = lc.SplitLinear(w, b, FEW, many, from_rows=8)
    few_layer, many_layer = FEW(w, b), many(w, b)
    for rows in (1, 7, 8, 33):
        x = torch.randn(rows, 40, generator=gen).bfloat16()
        want = (many_layer if rows >= 8 else few_layer)(x)
        torch.testing.assert_close(split(x), want, atol=0, rtol=0)
    x3 = torch.randn(2, 5, 40, generator=gen).bfloat16()  # leading dims: 10 rows
    torch.testing.assert_close(split(x3), many_layer(x3), atol=0, rtol=0)
    assert split(x3).shape == (2, 5, 72)


def test_interleaved_samples_take_each_runs_best_and_spread_a_burst_over_all_runs(monkeypatch):
    now, calls = [0.0], []

    def run_for(key, cost):
        def run():
            calls.append(key)
            # the machine is busy during the second timed round: 10x slower for every run
            now[0] += cost * (10 if len(calls) in (5, 6) else 1)
        return run

    monkeypatch.setattr(lc.time, "perf_counter", lambda: now[0])
    best = lc.interleaved_best({"a": run_for("a", 1.0), "b": run_for("b", 2.0)}, reps=3)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # one untimed call each, then rounds in turn
    assert best == {"a": 1.0, "b": 2.0}
