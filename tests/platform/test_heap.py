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


EXIT_SCRIPT = """
import sys
from loraplex.platform.heap import freeze_startup_heap

class Held:
    def __del__(self):
        sys.stdout.write("finalized\\n")

held = Held()
held.cycle = held  # only the cyclic collector can free it, as at interpreter shutdown
freeze_startup_heap()
freeze_startup_heap()
"""


def test_the_frozen_heap_is_finalized_at_exit_as_an_unfrozen_one_is():
    # objects left frozen at exit are never finalized: extension libraries then print
    # leak reports, which break a log that must be JSON line for line
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["finalized"] and out.stderr == ""
