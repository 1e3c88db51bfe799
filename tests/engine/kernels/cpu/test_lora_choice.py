"""Which LoRA segments oneDNN serves on this CPU: the measured crossover between the C
kernel and the per-segment torch loop, and the C backend that follows it."""
from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels.cpu import lora as cpu_lora, lora_choice as lc
from loraplex.engine.kernels.cpu.linear_choice import MARGIN
from loraplex.engine.kernels.torch.linear import packing_supported
from tests.engine.kernels.kernel_cases import llama_shapes

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


def test_measure_times_both_paths_at_bucketed_lengths():
    times = lc.measure(rows=(cpu_lora.BUCKET, 2 * cpu_lora.BUCKET), reps=1)
    assert sorted(times) == [cpu_lora.BUCKET, 2 * cpu_lora.BUCKET]
    assert all(c > 0 and d > 0 for c, d in times.values())
    with pytest.raises(AssertionError):  # the torch path is only ever given whole buckets
        lc.measure(rows=(cpu_lora.BUCKET + 1,))


@bf16_onednn
def test_the_measured_choice_is_a_measured_row_count_and_kept_per_thread_count():
    start = lc.torch_from_rows(torch.bfloat16)
    assert start is None or start in lc.ROWS
    assert lc.torch_from_rows(torch.bfloat16) == start  # measured once
    assert lc._torch_from_rows.cache_info().currsize >= 1


def test_fp32_stays_on_the_c_kernel():
    assert lc.torch_from_rows(torch.float32) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_c_backend_takes_the_choice_into_its_batches(dtype):
    out, _inp, group_in = llama_shapes(64, 64, 16, 128)
    lora = cpu_lora.CLoRABackend(2, 1, group_in, out, 8, dtype, torch.device("cpu"))
    assert lora.torch_from_rows == lc.torch_from_rows(dtype)
    lora.torch_from_rows = cpu_lora.BUCKET  # whatever this CPU measured
    batch = lora.batch([(0, 1, 0), (1, 1 + 2 * cpu_lora.BUCKET + 5, 1)])
    assert batch.torch is not None and batch.torch.segments == [(1, 1 + 2 * cpu_lora.BUCKET, 1)]
    assert batch.torch.slots is lora.packed
    assert batch.pieces.tolist() == [[0, 1, 0], [1 + 2 * cpu_lora.BUCKET, 1 + 2 * cpu_lora.BUCKET + 5, 1]]
