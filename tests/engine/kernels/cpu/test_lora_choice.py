"""Which LoRA segments oneDNN serves on this CPU: the measured crossover between the C
kernel and the per-segment torch loop, and the C backend that follows it."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels.cpu import lora as cpu_lora, lora_choice as lc
from loraplex.engine.kernels.cpu.linear_choice import MARGIN
from loraplex.engine.kernels.cpu.lora_backend import CLoRABackend
from loraplex.engine.kernels.torch.linear import packing_supported
from loraplex.engine.lora import pack_adapter
from tests.engine.kernels.kernel_cases import llama_shapes, random_adapter

pytestmark = pytest.mark.skipif(cpu_lora.load_library() is None, reason="no C compiler to build the CPU kernels")
bf16_onednn = pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.bfloat16),
                                 reason="oneDNN has no native bf16 path on this CPU")


def test_crossover_on_lora_timings():
    """rows -> (C, oneDNN) seconds shaped like a Xeon with AMX, an EPYC, and a win at a
    few rows below a loss (it must win at every count above the crossover)."""
    amx_like = {64: (1.3, 1.0), 128: (1.3, 1.3), 256: (2.5, 1.7), 512: (4.9, 2.5), 1024: (9.7, 4.0)}
    assert lc.crossover(amx_like) == 256
    epyc_like = {64: (1.0, 2.0), 256: (4.0, 4.5), 1024: (16.0, 14.0)}  # faster at 1024, within noise
    assert lc.crossover(epyc_like) is None
    assert lc.crossover({64: (1.0, 0.5), 128: (1.0, 2.0), 256: (4.0, 1.0), 1024: (16.0, 2.0)}) == 256
    assert lc.crossover({64: (MARGIN * 1.01, 1.0), 1024: (9.0, 1.0)}) == 64  # oneDNN for every bucket


def test_rows_for_a_rank_takes_the_largest_measured_rank_below_it():
    found = lc.Crossovers({8: 512, 16: 256, 32: None})
    assert [found.rows_for(r) for r in (1, 8, 12, 16, 31)] == [512, 512, 512, 256, 256]
    assert found.rows_for(32) is None and found.rows_for(128) is None


def test_measure_times_both_paths_at_bucketed_lengths():
    times = lc.measure(4, rows=(cpu_lora.BUCKET, 2 * cpu_lora.BUCKET), reps=1)
    assert sorted(times) == [cpu_lora.BUCKET, 2 * cpu_lora.BUCKET]
    assert all(c > 0 and d > 0 for c, d in times.values())
    with pytest.raises(AssertionError):  # the torch path is only ever given whole buckets
        lc.measure(4, rows=(cpu_lora.BUCKET + 1,))


@bf16_onednn
def test_the_measured_choice_is_a_measured_row_count_per_rank_and_kept_per_thread_count():
    found = lc.crossovers(torch.bfloat16)
    measured = lc._crossovers(torch.get_num_threads())
    assert sorted(measured) == list(lc.RANKS) and all(r is None or r in lc.ROWS for r in measured.values())
    assert found is (measured if any(r is not None for r in measured.values()) else None)
    assert lc.crossovers(torch.bfloat16) is found  # measured once


def test_fp32_stays_on_the_c_kernel():
    assert lc.crossovers(torch.float32) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_c_backend_takes_the_choice_into_its_batches(dtype):
    """Each segment is split at the crossover of its adapter's largest rank."""
    out, inp, group_in = llama_shapes(64, 64, 16, 128)
    cpu, b = torch.device("cpu"), cpu_lora.BUCKET
    lora = CLoRABackend(2, 1, group_in, out, 8, dtype, cpu)
    assert lora.crossovers is lc.crossovers(dtype)
    for slot, rank in enumerate((4, 32)):
        lora.set_slot(slot, pack_adapter(random_adapter({"q_proj": 2, "v_proj": rank}, inp, out, 1, slot), out, 1,
                                         dtype, cpu))
    assert lora.slot_ranks == [4, 32]
    lora.crossovers = lc.Crossovers({8: 3 * b, 32: b})  # whatever this CPU measured
    assert [lora.torch_from_rows(s) for s in (0, 1)] == [3 * b, b]
    segments = [(0, 1, 0), (1, 1 + 2 * b + 5, 1), (1 + 2 * b + 5, 1 + 4 * b + 5, 0)]
    batch = lora.batch(segments)
    assert batch.torch is not None and batch.torch.segments == [(1, 1 + 2 * b, 1)]
    assert batch.torch.slots is lora.packed
    assert batch.pieces[:, 1].sub(batch.pieces[:, 0]).sum() == 1 + 5 + 2 * b
    lora.crossovers = None
    assert lora.batch(segments).torch is None
