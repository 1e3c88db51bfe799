"""Real loraplex processes on loopback for the fleet tests and bench_scaleout: engine
workers (`loraplex worker`), gateways (`loraplex gateway`) and the all-in-one `serve`,
each on a free port, one torch thread, their logs in a file (shown when one fails)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
INTERNAL_TOKEN = "fleet-test-internal-" + "t" * 24
ADMIN_TOKEN = "fleet-test-admin-" + "a" * 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "LORAPLEX_INTERNAL_TOKEN": INTERNAL_TOKEN,
           "LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("LORAPLEX_DATABASE_URL", None)
    env.pop("LORAPLEX_DATA_DIR", None)
    return {**env, **(extra or {})}


@dataclass
class Proc:
    """One loraplex process; `start()` again after it exited restarts it on the same port."""

    role: str
    argv: list[str]
    port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Proc:
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen([sys.executable, "-m", "loraplex.platform.cli.main", *self.argv], cwd=REPO,
                                          stdout=out, stderr=subprocess.STDOUT, env=_env(self.env))
        return self

    def wait_ready(self, timeout: float = 180.0) -> Proc:
        deadline = time.monotonic() + timeout
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.role} exited with {self.popen.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.role} not ready after {timeout:g} s:\n{self.tail()}")
            time.sleep(0.1)

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def kill9(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(30)

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.popen is None or self.popen.poll() is not None:
            return None if self.popen is None else self.popen.returncode
        self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
            raise RuntimeError(f"{self.role} did not stop on SIGTERM:\n{self.tail()}") from None

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def metrics(self) -> str:
        # A worker's /metrics needs the internal token (its series name adapters); a gateway's ignores it.
        return httpx.get(self.url + "/metrics", headers={"authorization": f"Bearer {INTERNAL_TOKEN}"}, timeout=10).text


def worker(model_dir: Path, database_url: str, logs: Path, name: str, *extra: str) -> Proc:
    port = free_port()
    argv = ["worker", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--threads", "1",
            "--dtype", "float32", "--database-url", database_url, "--data-dir", str(logs / f"{name}-data"), *extra]
    return Proc(name, argv, port, logs / f"{name}.log")


def gateway(workers: list[Proc], database_url: str, logs: Path, name: str, *extra: str) -> Proc:
    port = free_port()
    argv = ["gateway", "--workers", ",".join(w.url for w in workers), "--host", "127.0.0.1", "--port", str(port),
            "--database-url", database_url, "--data-dir", str(logs / f"{name}-data"), *extra]
    if "--metrics-port" not in extra:
        argv += ["--metrics-port", "0"]  # /metrics on the main port: no two processes share the default one
    return Proc(name, argv, port, logs / f"{name}.log")


def serve(model_dir: Path, logs: Path, name: str, *extra: str) -> Proc:
    port = free_port()
    argv = ["serve", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--threads", "1",
            "--dtype", "float32", "--no-demo", "--data-dir", str(logs / f"{name}-data"), *extra]
    if "--metrics-port" not in extra:
        argv += ["--metrics-port", "0"]  # as for gateways: another server on this machine may hold the default
    return Proc(name, argv, port, logs / f"{name}.log")


_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`, in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m["name"] != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m["value"])
    return total


def adapter_requests(proc: Proc, adapter_name: str, digest: str) -> float:
    """Requests `proc` (a worker) counted for an adapter, labelled by its name or its digest."""
    text = proc.metrics()
    return (metric(text, "loraplex:adapter_requests_total", adapter=adapter_name)
            + metric(text, "loraplex:adapter_requests_total", adapter=digest))
