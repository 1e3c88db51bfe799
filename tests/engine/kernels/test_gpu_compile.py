"""Every kernel, as its launcher launches it, compiles to a cubin for sm_90 and sm_80.

The interpreter runs code a GPU compiler would reject; Triton's compiler (with the
ptxas its wheel ships) needs no GPU, so this runs on any machine with Triton."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton==3.9.0 --no-deps)")

SCRIPT = Path(__file__).with_name("gpu_compile_check.py")


def test_kernels_compile_for_nvidia_gpus():
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"no ptxas at {ptxas}: this Triton build cannot compile for NVIDIA GPUs")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "90", "80"], capture_output=True, text=True, env=env,
                          cwd=SCRIPT.parents[3], timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "0 failures" in proc.stdout
