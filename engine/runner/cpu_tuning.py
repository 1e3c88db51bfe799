"""Process-level settings that make the CPU forward pass fast.

glibc's malloc hands every allocation above its mmap threshold (128 KiB at first) to a
fresh mmap and returns it to the kernel on free. A forward pass allocates and frees
hundreds of activation tensors of a few MiB per step, so each one page-faults its
memory in again: measured on SmolLM2, a 1024-token prefill step spent a third of its
time in page faults (elementwise ops ran 8x slower than on warm memory). Raising the
mmap and trim thresholds keeps freed activations in the heap for the next step.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX);
# larger tensors (the KV cache, weights) still get their own mappings, which is right.
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 1 << 30
_TOP_PAD = 64 << 20

_done = False


def keep_freed_memory_in_heap() -> bool:
    """Raise glibc malloc's thresholds once per process; False where there is no glibc."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt, nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD), (_M_TOP_PAD, _TOP_PAD)))
    if not ok:
        log.debug("mallopt refused a setting; allocator left as it was")
    _done = ok
    return ok
