"""The demo adapters, trained in the background from the start of a run that needs them.

On a machine that has not trained them yet, the first test that needs them would train
them in its fixture, holding its xdist worker for minutes while the other waits on the
same lock. Started with the session instead, at the lowest CPU priority on one thread,
the training takes the CPU the tests leave idle (servers starting, clients waiting),
and the fixtures find the adapters cached, or wait on the cache's lock for the rest.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# The test modules whose fixtures need the demo adapters of the default model.
NEEDS_DEMO = ("tests/adapters/test_demo.py", "tests/engine/lora/test_smollm2.py")

_TRAIN = """
import torch
torch.set_num_threads(1)
from loraplex.adapters.demo import ensure_demo_adapters
from loraplex.engine.checkpoint import resolve_model_dir
ensure_demo_adapters(resolve_model_dir("default"))
"""


def selected(args: list[str], root: Path) -> bool:
    """Whether the run's path arguments take in a module that needs the demo adapters."""
    targets = [root / rel for rel in NEEDS_DEMO]
    for arg in args or ["."]:
        path = Path(arg.split("::")[0])
        path = (path if path.is_absolute() else Path.cwd() / path).resolve()
        if any(path == t or path in t.parents for t in targets):
            return True
    return False


def start(log: Path) -> subprocess.Popen:
    """The training process (it returns at once where the adapters are cached already)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-c", _TRAIN], stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=lambda: os.nice(19))


def stop(proc: subprocess.Popen) -> None:
    """End a training the run no longer waits for (a run of a few tests that finished
    first); the cache keeps nothing of it, and the next run starts afresh."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
