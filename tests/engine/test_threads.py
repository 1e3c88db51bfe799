"""A thread made serial for torch starts no OpenMP team of its own (in a process of its
own: OpenMP teams live as long as their threads, and the test counts the process's
threads)."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import os, sys, threading, torch
from loraplex.engine.threads import serial_torch_thread
torch.set_num_threads(2)
big = torch.ones(4_000_000)
big.add_(1)  # the main thread's team: one worker beside it
before = len(os.listdir("/proc/self/task"))
counted, done = [], threading.Event()

def work():
    if sys.argv[1] == "serial":
        serial_torch_thread()
    torch.ones(4_000_000).mul_(2)  # large enough for torch to go parallel
    counted.append(len(os.listdir("/proc/self/task")) - before)
    done.wait()

t = threading.Thread(target=work)
t.start()
while not counted:
    pass
done.set()
t.join()
print(counted[0], torch.get_num_threads())
"""


def _extra_threads(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    extra, threads = out.stdout.split()
    return int(extra), int(threads)


def test_a_serial_thread_adds_itself_and_no_openmp_workers():
    assert _extra_threads("plain") == (2, 2)  # the thread and its team's worker
    assert _extra_threads("serial") == (1, 2)  # the thread alone; the process keeps 2 threads
