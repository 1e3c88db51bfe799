"""Which kernel backend (backend.REGISTRY) runs on this device: "cpu", "triton" or "torch"."""
from __future__ import annotations

import importlib.util
import logging
import os

import torch

log = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "cpu", "torch")


def triton_available() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# The dtypes the C kernels are built for (cpu/*.c): bf16 and fp32.
CPU_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def select_backend(kernels: str, device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """`EngineConfig.kernels` ("auto" | "triton" | "cpu" | "torch") and the model's device
    -> the name of the kernel backend to create (backend.create_backend).

    "auto" is Triton on CUDA (when Triton is installed); on a CPU it is "cpu" (the C
    kernels under cpu/: decode and prefill attention, fused layer steps, multi-LoRA)
    where a C compiler can build them and `dtype` is one they take, else "torch".
    "triton" forced on a CPU device runs Triton's interpreter, which must have been
    switched on with TRITON_INTERPRET=1 before the kernel modules were imported: that
    is for tests.
    """
    if kernels not in BACKENDS:
        raise ValueError(f"unknown kernels setting {kernels!r}; use one of {BACKENDS}")
    device = torch.device(device)
    if kernels == "torch":
        return "torch"
    if kernels == "cpu" or (kernels == "auto" and device.type == "cpu"):
        return _cpu_backend(kernels == "cpu", device, dtype)
    if kernels == "auto":
        if device.type != "cuda":
            return "torch"
        if not triton_available():
            log.warning("CUDA device but Triton is not installed: running the torch kernels")
            return "torch"
        return "triton"
    if not triton_available():
        raise RuntimeError("kernels='triton' but Triton is not installed (pip install triton)")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(f"kernels='triton' on device {device.type!r} needs Triton's interpreter: "
                           "set TRITON_INTERPRET=1 before starting (slow; for tests)")
    return "triton"


def _cpu_backend(forced: bool, device: torch.device, dtype: torch.dtype) -> str:
    from .cpu import decode, draw, fused, lora, nucleus, prefill

    if device.type != "cpu":
        raise RuntimeError(f"kernels='cpu' runs on a CPU device, not {device.type!r}")
    if dtype not in CPU_KERNEL_DTYPES:
        if forced:
            raise RuntimeError(f"kernels='cpu' takes bfloat16 or float32, not {dtype}")
        return "torch"
    if all(lib.load_library() is not None for lib in (decode, draw, fused, lora, nucleus, prefill)):
        return "cpu"
    if forced:
        raise RuntimeError("kernels='cpu' but the C kernels could not be built (see the log)")
    return "torch"
