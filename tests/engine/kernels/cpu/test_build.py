"""Loading the C kernels leaves the process's float arithmetic as it was."""
from __future__ import annotations

import subprocess
import sys

import pytest

from loraplex.engine.kernels.cpu import gemm as cpu_gemm

# Run in a fresh interpreter: the floating-point mode is per process (per thread, and
# threads inherit it), so a library that changed it earlier in the suite would hide it.
PROBE = """
import sys, threading, torch
from loraplex.engine.kernels.cpu import decode, dpbf16, fused, gemm, lora, prefill
for module in (decode, dpbf16, fused, gemm, lora, prefill):
    module.load_library()
def subnormals_survive():
    tiny = sys.float_info.min / 2  # a subnormal: zero under flush-to-zero / denormals-are-zero
    t = torch.tensor([1e-40], dtype=torch.float32)
    return tiny > 0 and tiny * 2 == sys.float_info.min and bool((t * 1.0 > 0).item())
seen = []
worker = threading.Thread(target=lambda: seen.append(subnormals_survive()))
worker.start(); worker.join()
print(subnormals_survive(), seen[0])
"""


def test_loading_every_kernel_keeps_subnormal_floats():
    if cpu_gemm.load_library() is None:
        pytest.skip("no C compiler to build the CPU kernels")
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "True"], proc.stdout
