"""/health latency while one client attacks a real `loraplex serve`, against idle.

Starts `loraplex serve` (tiny random Llama by default) with a tenant, then runs each
attack for `--seconds` while a prober sends GET /health back to back, and prints the
prober's p50/p99/max latency and their ratios to the idle baseline measured in the same
run. Nothing is asserted (tests/e2e/resources/ asserts refusals and health).

Attacks: 50 MB bodies (declared and chunked), 8 MB prompts, 64 streams cut early, 200
slowloris connections, a flood of random API keys, zip-bomb uploads.

    python benchmarks/bench_resilience.py [--seconds 5] [--model tiny|default|PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from workload import percentile  # noqa: E402

from loraplex.platform.db.database import Database, migrate  # noqa: E402
from loraplex.platform.tenancy.tenants import create_key, create_tenant  # noqa: E402

ADMIN_TOKEN = "bench-resilience-admin-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, tmp: Path) -> None:
        url = f"sqlite:///{tmp / 'db.sqlite'}"
        migrate(url)
        db = Database(url)
        create_tenant(db, "bench", "standard")
        self.key = create_key(db, "bench")
        db.dispose()
        self.port = free_port()
        cmd = [sys.executable, "-c", "from loraplex.platform.cli.main import main; main()", "serve", "--model", model,
               "--data-dir", str(tmp / "data"), "--database-url", url, "--no-demo", "--port", str(self.port),
               "--metrics-port", str(free_port()), "--threads", "1", "--dtype", "float32", "--max-num-seqs", "64",
               "--max-body-size", "16MiB", "--header-timeout", "2"]
        env = {**os.environ, "LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise SystemExit("serve did not start")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def probe(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            client.get(f"{url}/health")
            out.append(time.perf_counter() - t0)


def _send_until_answered(port: int, head: str, frame: bytes, total: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head.encode())
        sent = 0
        while sent < total and not select.select([s], [], [], 0)[0]:
            try:
                s.sendall(frame)
            except OSError:
                return
            sent += len(frame)
        try:
            s.recv(65536)
        except OSError:
            pass


def big_bodies(srv: Server, stop: threading.Event) -> None:
    piece = b"x" * (64 << 10)
    while not stop.is_set():
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {srv.key}\r\n"
                f"Content-Length: {50 << 20}\r\n\r\n")
        _send_until_answered(srv.port, head, piece, 50 << 20)
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {srv.key}\r\n"
                "Transfer-Encoding: chunked\r\n\r\n")
        _send_until_answered(srv.port, head, b"%x\r\n%s\r\n" % (len(piece), piece), 50 << 20)


def huge_prompts(srv: Server, stop: threading.Event) -> None:
    # Encoded once: the attacking thread then only does socket I/O, not the prober's GIL.
    body = json.dumps({"prompt": "lorem ipsum " * ((8 << 20) // 12), "max_tokens": 1}).encode()
    headers = {"Authorization": f"Bearer {srv.key}", "Content-Type": "application/json"}
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            client.post(f"{srv.url}/v1/completions", content=body, headers=headers)


def cut_streams(srv: Server, stop: threading.Event) -> None:
    body = json.dumps({"prompt": "count", "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {srv.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    while not stop.is_set():
        socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=60) for _ in range(64)]
        for s in socks:
            s.sendall(head + body)
        for s in socks:
            s.recv(4096)
            s.close()


def slowloris(srv: Server, stop: threading.Event) -> None:
    line = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
    socks: list[tuple[socket.socket, int]] = []
    while not stop.is_set():
        socks = [(s, i) for s, i in socks if i < len(line)]
        while len(socks) < 200:
            socks.append((socket.create_connection(("127.0.0.1", srv.port), timeout=60), 0))
        alive = []
        for s, i in socks:
            try:
                s.sendall(line[i:i + 1])
                alive.append((s, i + 1))
            except OSError:
                s.close()  # the server dropped it: open another
        socks = alive
        time.sleep(0.05)
    for s, _ in socks:
        s.close()


def random_keys(srv: Server, stop: threading.Event) -> None:
    with httpx.Client(timeout=60) as client:
        n = 0
        while not stop.is_set():
            n += 1
            client.get(f"{srv.url}/v1/models", headers={"Authorization": f"Bearer lpx_{n:012x}_nope"})


def zip_bombs(srv: Server, stop: threading.Event) -> None:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(bytes(1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    data, size = block * 512 + c.flush(), 512 << 20
    name = b"adapter_model.safetensors"
    local = (b"PK\x03\x04" + (20).to_bytes(2, "little") + bytes(4) + (8).to_bytes(2, "little") + bytes(8)
             + len(data).to_bytes(4, "little") + size.to_bytes(4, "little") + len(name).to_bytes(2, "little")
             + bytes(2) + name + data)
    central = (b"PK\x01\x02" + (20).to_bytes(2, "little") * 2 + bytes(2) + (8).to_bytes(2, "little") + bytes(8)
               + len(data).to_bytes(4, "little") + size.to_bytes(4, "little") + len(name).to_bytes(2, "little")
               + bytes(12) + name)
    end = (b"PK\x05\x06" + bytes(4) + (1).to_bytes(2, "little") * 2 + len(central).to_bytes(4, "little")
           + len(local).to_bytes(4, "little") + bytes(2))
    bomb = local + central + end
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            client.post(f"{srv.url}/admin/api/adapters", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                        data={"name": "bomb"}, files=[("files", ("bomb.zip", bomb))])


ATTACKS: dict[str, Callable[[Server, threading.Event], None]] = {
    "50 MB bodies": big_bodies, "8 MB prompts": huge_prompts, "64 streams cut": cut_streams,
    "slowloris x200": slowloris, "random keys": random_keys, "zip bombs": zip_bombs,
}


def phase(srv: Server, seconds: float, attack: Callable | None) -> list[float]:
    stop, lat = threading.Event(), []
    threads = [threading.Thread(target=probe, args=(srv.url, stop, lat))]
    if attack is not None:
        threads.append(threading.Thread(target=attack, args=(srv, stop), daemon=True))
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    threads[0].join()
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="per phase")
    ap.add_argument("--model", default="tiny", help="tiny (random 2-layer Llama), default (SmolLM2) or a folder")
    ap.add_argument("--only", action="append", choices=list(ATTACKS), help="run only these attacks (repeatable)")
    args = ap.parse_args()
    attacks = {k: v for k, v in ATTACKS.items() if not args.only or k in args.only}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        model = args.model
        if model == "tiny":
            from tests.helpers.tiny_models import build_tiny_model_dir

            model = str(build_tiny_model_dir(tmp / "tiny", "llama"))
        srv = Server(model, tmp)
        try:
            idle = phase(srv, args.seconds, None)
            base = {q: percentile(idle, q) for q in (50, 99)} | {"max": max(idle)}
            print(f"{'phase':16} {'probes':>7} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}   ratios to idle p50/p99/max")
            print(f"{'idle':16} {len(idle):7d} {base[50] * 1e3:9.2f} {base[99] * 1e3:9.2f} {base['max'] * 1e3:9.2f}")
            for name, attack in attacks.items():
                lat = phase(srv, args.seconds, attack)
                p50, p99, mx = percentile(lat, 50), percentile(lat, 99), max(lat)
                print(f"{name:16} {len(lat):7d} {p50 * 1e3:9.2f} {p99 * 1e3:9.2f} {mx * 1e3:9.2f}   "
                      f"{p50 / base[50]:.1f}x / {p99 / base[99]:.1f}x / {mx / base['max']:.1f}x", flush=True)
        finally:
            srv.stop()


if __name__ == "__main__":
    main()
