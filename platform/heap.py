"""The heap a process built to start (model, tokenizer, app), frozen out of the cyclic GC.

A full collection walks every container object the process holds, and a loaded model
with its tokenizer and libraries is hundreds of thousands of them: one full collection
then holds the interpreter lock for ~0.2 s on these machines, stalling the event loop
and the engine thread alike. Allocating many objects, as parsing one large request body
does, is what sets off full collections, so one tenant's big bodies would make every
tenant wait. What is frozen is what lives as long as the process anyway; collections
after it walk only what was made since (measured: ~10 ms instead of ~200 ms).

At exit the heap is handed back to the collector, so that interpreter shutdown finalizes
it as it would have: extension libraries (triton's nanobind objects) otherwise report
their frozen instances as leaks on stderr, and objects with finalizers never run them.
"""
from __future__ import annotations

import atexit
import gc


def freeze_startup_heap() -> int:
    """Collect once, then move every object left out of the collector's reach; returns
    how many objects are frozen."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often a process freezes
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()
