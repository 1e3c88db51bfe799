"""Kernel tests run Triton's interpreter on CPU tensors.

TRITON_INTERPRET must be set before any kernel module is imported (`triton.jit` decides
at decoration time), so it is set here, at import, before pytest imports the tests of
this folder. Without Triton installed every test here skips (pytest.importorskip).
"""
from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

_KERNEL_MODULES = ("loraplex.engine.kernels.triton.paged_attention", "loraplex.engine.kernels.triton.kv_write",
                   "loraplex.engine.kernels.triton.lora")
_early = [m for m in _KERNEL_MODULES if m in sys.modules]
if _early:  # compiled for a GPU already: the interpreter cannot take over any more
    raise RuntimeError(f"{_early} were imported before TRITON_INTERPRET=1 was set; run the kernel tests "
                       "in their own process or import the kernel modules only inside tests/engine/kernels")
