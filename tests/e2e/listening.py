"""Waiting for a `loraplex` child process to accept connections, read from its log.

uvicorn logs "Application startup complete" when the app's lifespan has started and only
then binds its socket, so a test that connects on that line can be refused. Its
"Uvicorn running on http://HOST:PORT" line comes after the bind."""
from __future__ import annotations

import subprocess
import time


def read_until_listening(proc: subprocess.Popen, ports: list[int], lines: list[str], timeout: float) -> None:
    """Read `proc`'s text stdout into `lines` until every port in `ports` is bound; raise,
    with the output so far, if the process exits or `timeout` seconds pass first."""
    waiting = set(ports)
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError("the process exited before it listened:\n" + "".join(lines))
        lines.append(line)
        if "Uvicorn running on" in line:
            waiting -= {p for p in waiting if f":{p} " in line or line.rstrip().endswith(f":{p}")}
    if waiting:
        proc.kill()
        raise AssertionError(f"not listening on {sorted(waiting)} after {timeout:g} s:\n" + "".join(lines))
