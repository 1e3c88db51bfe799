"""The C decode-attention kernel (cpu_decode.c): build once per machine, call via ctypes.

The kernel is compiled on first use with the machine's C compiler for the machine's
own CPU (-march=native) into ~/.cache/loraplex/kernels (locked, atomic), like Triton
caches its GPU kernels. Without a compiler the engine keeps the torch path
(engine/attention.py), which is also this kernel's reference in the tests.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..attention import AttentionMetadata, prefill_attention
from ..loader import default_cache_dir, file_lock

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-shared", "-fPIC", "-std=c11"]
_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 5 + [ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
# Below this many (sequence, KV head) items a second thread costs more than it saves.
_MIN_ITEMS_PER_THREAD = 16

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None
_pool: ThreadPoolExecutor | None = None


def _cpu_tag() -> str:
    # -march=native code is only valid on the CPU it was built for.
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def _build(target: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[:500]}")
        os.replace(out, target)


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (reason logged once) where it cannot be built."""
    global _lib, _failed
    with _lock:
        if _lib is not None or _failed is not None:
            return _lib
        digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
        folder = default_cache_dir() / "kernels"
        target = folder / f"cpu_decode-{digest}-{_cpu_tag()}.so"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with file_lock(folder / ".cpu_decode.lock"):
                if not target.exists():
                    _build(target)
            lib = ctypes.CDLL(str(target))
            for name in ("paged_decode_bf16", "paged_decode_f32"):
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
            _lib = lib
        except (OSError, RuntimeError) as exc:
            _failed = str(exc)
            log.warning("CPU decode kernel unavailable, using the torch path: %s", exc)
        return _lib


def cpu_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, scale: float) -> None:
    """out[s] = attention of decode query q[s] ([D, heads, head_dim]) over its first
    seq_lens[s] cached positions, found through block_tables[s]."""
    lib = load_library()
    assert lib is not None, "load_library() returned None: use the torch path"
    D, H, Dh = q.shape
    KVH, slots = k_cache.shape[0], k_cache.shape[1]
    assert q.dtype == k_cache.dtype == v_cache.dtype == out.dtype and q.dtype in (torch.bfloat16, torch.float32)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == Dh and H % KVH == 0, (q.shape, k_cache.shape)
    assert q.is_contiguous() and out.is_contiguous() and out.shape == q.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slots % block_size == 0
    assert block_tables.dtype == seq_lens.dtype == torch.int32 and block_tables.is_contiguous()
    assert block_tables.shape[0] >= D and seq_lens.shape[0] >= D and seq_lens.is_contiguous()
    fn = lib.paged_decode_bf16 if q.dtype == torch.bfloat16 else lib.paged_decode_f32
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), block_tables.data_ptr(),
            seq_lens.data_ptr(), block_tables.shape[1], H, KVH, Dh, block_size, slots, scale)
    items = D * KVH
    parts = max(1, min(torch.get_num_threads(), items // _MIN_ITEMS_PER_THREAD))
    bounds = [items * i // parts for i in range(parts + 1)]
    futures = [_thread_pool().submit(fn, *args, bounds[i], bounds[i + 1]) for i in range(1, parts)]
    rcs = [fn(*args, bounds[0], bounds[1])] + [f.result() for f in futures]
    if any(rcs):
        raise ValueError(f"decode kernel refused the shapes (group {H // KVH}, head_dim {Dh}): codes {rcs}")


def cpu_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """engine.attention.paged_attention's contract: decodes through the C kernel, prefill
    chunks through the torch path's SDPA."""
    out = torch.empty_like(q)
    D = meta.num_decodes
    if D:
        assert meta.block_tables is not None and meta.seq_lens is not None, "metadata lacks the ragged form"
        q = q.contiguous()
        cpu_decode_attention(q[:D], k_cache, v_cache, out[:D], meta.block_tables, meta.seq_lens,
                             meta.block_size, scale)
    prefill_attention(q, k_cache, v_cache, meta, scale, out)
    return out


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="loraplex-attn")
    return _pool
