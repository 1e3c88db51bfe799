"""Build the engine's C kernels once per machine and run them through ctypes.

Each kernel source beside this file is compiled on first use with the machine's C
compiler for the machine's own CPU (-march=native) into ~/.cache/loraplex/kernels
(locked, atomic, keyed by source, flags and CPU), like Triton caches its GPU kernels.
Where it cannot be built (no compiler), `load` returns None and the engine keeps the
torch path, which is also every kernel's reference in the tests.

Kernels parallelise with OpenMP. They link libgomp.so.1, which torch has already
loaded, so they run on torch's own thread pool with its thread count: a second pool
of Python threads competed with torch's spinning OpenMP workers on a 2-core machine
(measured 174-210 against 225 tok/s with the kernels single-threaded).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from loraplex.adapters.files import file_lock

from ...checkpoint import default_cache_dir

log = logging.getLogger(__name__)

# -ffast-math lets reductions vectorise and exp use glibc's vector math. It also assumes
# no infinities, so the kernels are written never to make one (exp only of values <= 0).
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
# Linked apart from compiling: given -ffast-math, gcc links crtfastmath.o into a shared
# library too, whose constructor sets flush-to-zero in the loading process, changing
# the float arithmetic of Python, numpy and torch in every thread after it.
LINK_FLAGS = ["-shared", "-fopenmp"]

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}


def _cpu_tag() -> str:
    # -march=native code is only valid on the CPU it was built for.
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def _flags(march: str) -> list[str]:
    return [f"-march={march}" if f == "-march=native" else f for f in FLAGS]


def _compile(source: Path, target: Path, flags: list[str]) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, out = Path(tmp) / f"{target.stem}.o", Path(tmp) / target.name
        for argv in ([cc, *flags, "-c", str(source), "-o", str(obj)], [cc, *LINK_FLAGS, str(obj), "-o", str(out), "-lm"]):
            proc = subprocess.run(argv, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed on {source.name}: {proc.stderr.strip()[:500]}")
        os.replace(out, target)


def load(source_name: str, signatures: dict[str, list], march: str = "native") -> ctypes.CDLL | None:
    """The compiled library of `source_name` with `signatures` (function -> argtypes,
    all returning int) set, or None (reason logged once) where it cannot be built.
    `march`: another target than this CPU's own (the tests run each code path of a
    kernel, e.g. AVX2's on an AVX-512 machine; it must be one this CPU can run)."""
    key = source_name if march == "native" else f"{source_name}:{march}"
    with _lock:
        if key in _libs:
            return _libs[key]
        source = Path(__file__).with_name(source_name)
        flags = _flags(march)
        headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
        digest = hashlib.sha256(source.read_bytes() + headers + " ".join(flags + LINK_FLAGS).encode()).hexdigest()[:16]
        folder = default_cache_dir() / "kernels"
        target = folder / f"{source.stem}-{digest}-{_cpu_tag()}.so"
        lib = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with file_lock(folder / f".{source.stem}.lock"):
                if not target.exists():
                    _compile(source, target, flags)
            lib = ctypes.CDLL(str(target))
            for name, argtypes in signatures.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
        except (OSError, RuntimeError, AttributeError) as exc:
            lib = None
            log.warning("C kernel %s unavailable, using the torch path: %s", source_name, exc)
        _libs[key] = lib
        return lib


_recording = threading.local()


@contextlib.contextmanager
def recording(calls: list[tuple]) -> Iterator[None]:
    """Within the block, each `run` on this thread is also appended to `calls` as
    (fn, args, items), to be made again with `run` (runner/cpu_graphs.py)."""
    _recording.calls = calls
    try:
        yield
    finally:
        _recording.calls = None


def run(fn: Callable[..., int], args: tuple, items: int) -> None:
    """Call fn(*args, 0, items): the kernel shares its items out itself (OpenMP)."""
    calls = getattr(_recording, "calls", None)
    if calls is not None:
        calls.append((fn, args, items))
    rc = fn(*args, 0, items)
    if rc:
        raise ValueError(f"{getattr(fn, '__name__', 'C kernel')} refused its arguments (code {rc})")
