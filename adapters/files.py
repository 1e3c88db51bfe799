"""Files shared between processes: a cross-process lock and umask-respecting modes for
folders made with mkdtemp (the model cache, the demo adapters, the compiled kernels)."""
from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def apply_umask(folder: Path) -> None:
    # mkdtemp (and safetensors' own temp files) create owner-only modes; a shared cache
    # dir must stay readable by the other users the umask allows.
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # blocks while another process converts
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
