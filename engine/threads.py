"""Threads that call torch beside the engine thread, kept out of OpenMP.

Each thread that runs one of torch's OpenMP-parallel CPU kernels keeps a team of worker
threads for as long as it lives. Once the teams hold more threads than the machine has
cores, libgomp's workers stop spinning between parallel regions and sleep, and every
short region of a decode step then waits for them to wake: one adapter load on a
long-lived loader thread took a 2-core server from ~500 to ~380 output tok/s for the rest
of its life. The engine thread alone runs the model (async_engine.py); threads that touch
tensors beside it (adapter loading and validation) run torch serially.
"""
from __future__ import annotations

import asyncio
import ctypes
import functools
from concurrent.futures import ThreadPoolExecutor

import torch


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded, if it is GNU's (others keep no per-thread teams)."""
    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "libgomp" in line and "/" in line]
    return ctypes.CDLL(paths[0]) if paths else None


def serial_torch_thread() -> None:
    """From now on torch's CPU kernels run serially on the calling thread (others keep
    their thread count), so it never starts an OpenMP team of its own."""
    # torch sets a thread's OpenMP thread count the first time it asks for it (and only
    # then): let it, then lower this thread's own count.
    torch.get_num_threads()
    lib = _libgomp()
    if lib is not None:
        lib.omp_set_num_threads(1)


def serial_torch_executor(max_workers: int | None = None, thread_name_prefix: str = "") -> ThreadPoolExecutor:
    """A thread pool whose threads run torch serially."""
    return ThreadPoolExecutor(max_workers, thread_name_prefix=thread_name_prefix, initializer=serial_torch_thread)


def use_serial_default_executor() -> None:
    """The running loop's `asyncio.to_thread` pool runs torch serially (a server's adapter
    uploads validate tensors there)."""
    asyncio.get_running_loop().set_default_executor(serial_torch_executor(thread_name_prefix="loraplex-io"))
