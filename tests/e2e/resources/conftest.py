"""A real `loraplex serve` process on the tiny Llama for the resource suite: its own data
folder and SQLite database, tenant `acme` (with a concurrency quota, so reservations are
tracked) and an admin token; short header/body timeouts and a 16 MiB body limit, so an
8 MB prompt reaches the prompt-length check."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from loraplex.platform.db.database import Database, migrate
from loraplex.platform.quotas.limits import quota_status, set_quota
from loraplex.platform.tenancy.tenants import create_key, create_tenant
from tests.e2e.listening import read_until_listening
from tests.platform.fixtures import tiny_adapters  # noqa: F401 - fixture

ADMIN_TOKEN = "resource-suite-admin-token-" + "r" * 16
MAX_BODY = 16 << 20
SERVE_TIMEOUTS = ("--header-timeout", "2", "--body-timeout", "2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    port: int
    metrics_port: int
    key: str
    db: Database
    proc: subprocess.Popen
    model: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        return httpx.get(f"{self.url}/health", timeout=30).status_code == 200

    def engine_gauges(self) -> tuple[float, float]:
        """(requests running, requests waiting) from /metrics."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30).text
        values = {}
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            values[name] = sum(float(m.group(1)) for m in re.finditer(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))
        return values["vllm:num_requests_running"], values["vllm:num_requests_waiting"]

    def in_flight(self) -> int:
        return quota_status(self.db, "acme").in_flight


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama_dir) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("served")
    url = f"sqlite:///{root / 'db.sqlite'}"
    migrate(url)
    db = Database(url)
    create_tenant(db, "acme", "standard")
    set_quota(db, "acme", max_concurrency=1000)
    key = create_key(db, "acme")
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-u", "-c", "from loraplex.platform.cli.main import main; main()", "serve",
           "--model", str(tiny_llama_dir), "--data-dir", str(root / "data"), "--database-url", url,
           "--dtype", "float32", "--threads", "1", "--max-model-len", "256", "--num-kv-blocks", "1200",
           "--max-num-seqs", "64", "--no-demo", "--port", str(port), "--metrics-port", str(metrics_port),
           # One tenant sends several huge bodies back to back here, to reach the caps
           # behind the body budget (tests/e2e/isolation/ has the budget's own tests).
           "--max-body-size", str(MAX_BODY), "--max-body-rate", str(4 * MAX_BODY), *SERVE_TIMEOUTS]
    env = {**os.environ, "LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    read_until_listening(proc, [port, metrics_port], lines, timeout=180)
    # Keep reading its output, so a full pipe never blocks the server.
    import threading

    threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
    try:
        yield Served(port, metrics_port, key, db, proc, tiny_llama_dir.name)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        db.dispose()
    assert "Traceback" not in "".join(lines), "".join(lines)[-5000:]
