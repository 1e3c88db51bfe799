"""A real `loraplex serve` on the tiny Llama with two tenants (`acme`, `beta`) for the
cost-isolation suite. No address is a trusted proxy, so every loopback address
(127.0.0.1, 127.0.0.2, ...) is a client of its own; small caps make each one reachable:
4 connections per address, 24 in all, 64 KiB/s of request body per tenant, a 2 s body deadline (the head gets 30 s, so idle
connections stay open while a test needs them), and an address that failed to
authenticate 5 times stays throttled for the whole suite."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from loraplex.platform.db.database import Database, migrate
from loraplex.platform.tenancy.tenants import create_key, create_tenant
from tests.e2e.listening import read_until_listening
from tests.e2e.resources.conftest import free_port

ADMIN_TOKEN = "isolation-suite-admin-token-" + "i" * 16
PER_CLIENT = 4
MAX_CONNECTIONS = 24
MAX_BODY = 1 << 20
BODY_RATE = 64 << 10  # bytes per second per tenant, past a burst of one MAX_BODY


@dataclass
class Isolated:
    port: int
    keys: dict[str, str]
    db: Database
    model: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def http(self, source: str = "127.0.0.1") -> httpx.Client:
        """A client whose connections come from `source` (any 127.x.y.z address)."""
        return httpx.Client(base_url=self.url, timeout=60,
                            transport=httpx.HTTPTransport(local_address=source))

    def openai(self, tenant: str, source: str = "127.0.0.1", key: str | None = None) -> openai.OpenAI:
        """The official client, never retrying: a 429 or 503 must show as an error."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or self.keys[tenant], max_retries=0,
                             http_client=self.http(source))

    def connect(self, source: str) -> socket.socket:
        s = socket.socket()
        s.settimeout(60)
        s.bind((source, 0))
        s.connect(("127.0.0.1", self.port))
        return s


@pytest.fixture(scope="module")
def isolated(tmp_path_factory, tiny_llama_dir) -> Iterator[Isolated]:
    root = tmp_path_factory.mktemp("isolated")
    url = f"sqlite:///{root / 'db.sqlite'}"
    migrate(url)
    db = Database(url)
    keys = {}
    for tenant in ("acme", "beta"):
        create_tenant(db, tenant, "standard")
        keys[tenant] = create_key(db, tenant)
    port = free_port()
    cmd = [sys.executable, "-u", "-c", "from loraplex.platform.cli.main import main; main()", "serve",
           "--model", str(tiny_llama_dir), "--data-dir", str(root / "data"), "--database-url", url,
           "--dtype", "float32", "--threads", "1", "--max-model-len", "256", "--num-kv-blocks", "400",
           "--no-demo", "--port", str(port), "--metrics-port", "0", "--max-body-size", str(MAX_BODY),
           "--max-body-rate", str(BODY_RATE),
           "--forwarded-allow-ips", "192.0.2.1", "--header-timeout", "30", "--body-timeout", "2",
           "--max-connections", str(MAX_CONNECTIONS), "--max-connections-per-client", str(PER_CLIENT),
           "--auth-failure-burst", "5", "--auth-failure-rate", "0.001", "--refusal-hold", "0.5"]
    env = {**os.environ, "LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    read_until_listening(proc, [port], lines, timeout=180)
    threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
    try:
        yield Isolated(port, keys, db, tiny_llama_dir.name)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        db.dispose()
    assert "Traceback" not in "".join(lines), "".join(lines)[-5000:]
