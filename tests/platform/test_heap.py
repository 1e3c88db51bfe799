"""The startup heap is frozen out of the cyclic garbage collector (in a process of its
own: freezing is for a server's whole life, not a test's)."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc
from loraplex.platform.heap import freeze_startup_heap
kept = [[i] for i in range(50_000)]  # what a server built to start
cycle = [None]; cycle[0] = cycle; del cycle  # garbage: collected, not frozen
frozen = freeze_startup_heap()
after = [[i] for i in range(10)]  # made later: still the collector's
print(frozen, gc.get_freeze_count(), any(o is after for o in gc.get_objects()),
      any(o is kept for o in gc.get_objects()))
"""


def test_freezing_moves_what_lives_out_of_the_collectors_reach():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.split()
    frozen, count, later_tracked, kept_tracked = int(out[0]), int(out[1]), out[2] == "True", out[3] == "True"
    assert frozen == count >= 50_000
    assert later_tracked and not kept_tracked
