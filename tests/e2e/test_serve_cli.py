"""`loraplex serve` as a user runs it: migrate, demo tenant + key printed once, adapters, serve."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai

from tests.e2e.conftest import MAX_MODEL_LEN
from tests.e2e.listening import read_until_listening

KEY_LINE = re.compile(r"^\s+(lpx_[0-9a-f]{12}_\S+)\s*$")
ADMIN_LINE = re.compile(r"^\s+(lpxadmin_\S+)\s*$")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    def __init__(self, *args: str, env: dict) -> None:
        self.port, self.metrics_port = _free_port(), _free_port()
        cmd = [sys.executable, "-u", "-c", "from loraplex.platform.cli.main import main; main()", "serve",
               "--port", str(self.port), "--metrics-port", str(self.metrics_port), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []

    def wait_ready(self, timeout: float = 120) -> None:
        read_until_listening(self.proc, [self.port, self.metrics_port], self.lines, timeout)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self.lines.append(out)
        assert "Application shutdown complete" in out, out  # a graceful shutdown
        # uvicorn re-raises the signal it handled once shut down: -SIGTERM is a clean exit.
        return 0 if self.proc.returncode == -signal.SIGTERM else self.proc.returncode

    @property
    def keys(self) -> list[str]:
        return [m.group(1) for line in self.lines if (m := KEY_LINE.match(line))]

    @property
    def admin_tokens(self) -> list[str]:
        return [m.group(1) for line in self.lines if (m := ADMIN_LINE.match(line))]


def test_serve_first_start_and_restart(empty_db_url, tmp_path, tiny_llama_dir, tiny_adapters):
    env = {**{k: v for k, v in os.environ.items() if k != "LORAPLEX_ADMIN_TOKEN"},  # so one is generated
           "LORAPLEX_DEMO_ADAPTERS": str(tiny_adapters["ad1"].parent)}
    args = ["--model", str(tiny_llama_dir), "--data-dir", str(tmp_path / "data"), "--database-url", empty_db_url,
            "--dtype", "float32", "--threads", "1", "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "64",
            "--adapter", f"mine={tiny_adapters['ad2']}"]
    first = Serve(*args, env=env)
    try:
        first.wait_ready()
        assert len(first.keys) == 1, "".join(first.lines)
        assert any(f"127.0.0.1:{first.port}/v1" in line for line in first.lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{first.port}/v1", api_key=first.keys[0], max_retries=0)
        expected = {tiny_llama_dir.name, "ad1", "ad2", "ad3", "mine"}
        deadline = time.monotonic() + 60  # demo adapters are registered in the background
        while {m.id for m in client.models.list()} != expected and time.monotonic() < deadline:
            time.sleep(0.2)
        assert {m.id for m in client.models.list()} == expected
        r = client.chat.completions.create(model="mine", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.usage.completion_tokens >= 1
        # The admin token generated at first start signs in to the admin UI.
        assert len(first.admin_tokens) == 1, "".join(first.lines)
        admin = httpx.post(f"http://127.0.0.1:{first.port}/admin/api/session", json={"token": first.admin_tokens[0]})
        assert admin.status_code == 201, admin.text
        # /metrics is on its own (loopback) listener, not on the tenants' port.
        assert "vllm:" in httpx.get(f"http://127.0.0.1:{first.metrics_port}/metrics").text
        assert httpx.get(f"http://127.0.0.1:{first.port}/metrics").status_code == 404
    finally:
        assert first.stop() == 0, "".join(first.lines)
    second = Serve(*args, env=env)
    try:
        second.wait_ready()
        assert second.keys == [] and second.admin_tokens == []  # printed only on the first start
        r = httpx.get(f"http://127.0.0.1:{second.port}/admin/api/tenants",
                      headers={"authorization": f"Bearer {first.admin_tokens[0]}"})
        assert r.status_code == 200 and {t["name"] for t in r.json()} >= {"demo"}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{second.port}/v1", api_key=first.keys[0], max_retries=0)
        assert client.completions.create(model=tiny_llama_dir.name, prompt="x", max_tokens=2).choices
    finally:
        assert second.stop() == 0


def test_serve_bad_option_is_a_clean_error(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "from loraplex.platform.cli.main import main; main()", "serve",
                           "--model", str(tmp_path / "nope"), "--data-dir", str(tmp_path), "--no-demo"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "loraplex: error:" in proc.stderr and "nope" in proc.stderr
