"""benchmarks/bench_gpu.py on a machine without a GPU: its pure helpers, and its refusal."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from bench_gpu import assign_adapters, fraction, peak_for, ratio  # noqa: E402


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", (4800, 989)),
    ("NVIDIA H100 80GB HBM3", (3350, 989)),  # the SXM part
    ("NVIDIA H100 NVL", (3900, 835)),  # not the SXM H100, though "H100" is in its name
    ("NVIDIA H100 PCIe", (2000, 756)),
    ("NVIDIA A100-SXM4-80GB", (2039, 312)),
    ("NVIDIA A100-SXM4-40GB", (1555, 312)),
    ("NVIDIA L40S", (864, 362)),  # not an L4
    ("NVIDIA L4", (300, 121)),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_lookup_by_device_name(name, peak):
    assert peak_for(name) == peak


def test_fraction_and_ratio_formatting():
    assert fraction(3612.4, 4800, "GB/s") == "3612 GB/s = 75% of 4800"
    assert fraction(412.0, 989, "TFLOP/s") == "412 TFLOP/s = 42% of 989"
    assert fraction(950.0, None, "GB/s") == "950 GB/s (peak unknown)"
    assert ratio(3.0, 1.5) == "2.00x" and ratio(1.0, 0.0) == "-"


def test_adapters_are_assigned_round_robin():
    assert assign_adapters(5, ["a", "b"]) == ["a", "b", "a", "b", "a"]
    assert assign_adapters(3, []) == [None, None, None]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(BENCH / "bench_gpu.py")], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode != 0
    assert "bench_gpu.py: needs a CUDA GPU" in proc.stderr
