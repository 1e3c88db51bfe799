"""Helpers of the fault suite: a loopback TCP proxy the test can cut (PostgreSQL made
unreachable), a `loraplex serve` process to kill -9, and streaming clients that count the
tokens they received."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[3]


class TcpProxy:
    """127.0.0.1:<port> -> upstream, one pair of pump threads per connection. `cut()`
    closes every connection and refuses new ones (connection refused, as a database host
    that went away); `restore()` accepts again on the same port."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self.port = 0
        self.restore()

    def restore(self) -> None:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(64)
        self.port = ls.getsockname()[1]
        self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()

    def cut(self) -> None:
        ls, self._listener = self._listener, None
        if ls is not None:
            ls.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return  # cut
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not ls:
                    client.close()
                    server.close()
                    continue
                self._conns |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """`loraplex serve` in a child process."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-u", "-c", "from loraplex.platform.cli.main import main; main()", "serve",
               "--port", str(self.port), "--metrics-port", str(free_port()), *args]
        self.log = log
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self._out = open(log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("serve exited early:\n" + self.log.read_text())
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("serve did not start:\n" + self.log.read_text())

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._out.close()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        finally:
            self._out.close()
        assert "Application shutdown complete" in self.log.read_text()


@dataclass
class Stream:
    """One streamed completion; counts the tokens received (logprobs name each one)."""

    url: str
    key: str
    max_tokens: int
    request_id: str | None = None
    times: list[float] = field(default_factory=list)  # one per token received
    status: int | None = None
    finished: bool = False
    error: str | None = None

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "the crash test", "max_tokens": self.max_tokens, "stream": True,
                "logprobs": 0, "ignore_eos": True, "temperature": 0}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {self.key}"}) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = orjson.loads(line[6:])
                    if "error" in chunk:
                        self.error = chunk["error"]["message"]
                        continue
                    self.request_id = chunk["id"]
                    for choice in chunk["choices"]:
                        now = time.monotonic()
                        self.times += [now] * len((choice.get("logprobs") or {}).get("tokens") or [])
                        self.finished |= choice.get("finish_reason") is not None
        except httpx.HTTPError as exc:  # the server died under it
            self.error = f"{type(exc).__name__}: {exc}"

    @property
    def received(self) -> int:
        return len(self.times)

    def received_in_last(self, seconds: float) -> int:
        return sum(t >= self.times[-1] - seconds for t in self.times) if self.times else 0

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self.run, daemon=True)
        t.start()
        return t
