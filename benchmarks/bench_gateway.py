"""The gateway's own cost: one-token completions through HTTP vs calling the AsyncEngine directly.

One run, same engine, same prompt, both paths:
  (a) direct: `AsyncEngine.generate(prompt, max_tokens=1)` from an asyncio loop
  (b) HTTP:   POST /v1/completions (max_tokens=1, non-streaming) to a live uvicorn server
      (httptools + uvloop when installed) with API-key auth, SQLite, metrics; the client
      is a raw keep-alive socket per worker thread, so client-side cost stays negligible.
Each path runs sequentially (latency p50/p99) and with `--concurrency` workers (req/s).
Prints added latency (b - a) at p50/p99, the req/s ratio b/a, and the gateway thread's
CPU time per request (measured with the thread's own CPU clock).

    python benchmarks/bench_gateway.py                   # tiny random Llama: isolates the gateway
    python benchmarks/bench_gateway.py --model default   # SmolLM2-135M
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from workload import percentile  # noqa: E402

from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from loraplex.engine.request import SamplingParams  # noqa: E402
from loraplex.platform.app import create_app  # noqa: E402
from loraplex.platform.db.database import Database, migrate  # noqa: E402
from loraplex.platform.assembly.engine_factory import build_engine  # noqa: E402
from loraplex.platform.settings import AuthConfig, Settings  # noqa: E402
from loraplex.platform.tenancy.tenants import create_key, create_tenant  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog"


def thread_cpu(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


# -- (a) direct -------------------------------------------------------------------------
async def _direct_one(engine, sp: SamplingParams) -> float:
    t0 = time.perf_counter()
    async for _ in engine.generate(PROMPT, sp):
        pass
    return time.perf_counter() - t0


async def direct(engine, n: int, concurrency: int) -> tuple[list[float], float]:
    sp = SamplingParams(max_tokens=1, temperature=0)
    lat = [await _direct_one(engine, sp) for _ in range(n)]
    per = n // concurrency

    async def worker():
        for _ in range(per):
            await _direct_one(engine, sp)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat, per * concurrency / (time.perf_counter() - t0)


# -- (b) HTTP ---------------------------------------------------------------------------
class RawClient:
    """Keep-alive HTTP/1.1 over one socket; prebuilt request bytes."""

    def __init__(self, port: int, key: str, model: str) -> None:
        body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}).encode()
        self.request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def one(self) -> float:
        t0 = time.perf_counter()
        self.sock.sendall(self.request)
        while b"\r\n\r\n" not in self.buf:
            self.buf += self.sock.recv(65536)
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.decode())
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += self.sock.recv(65536)
        self.buf = rest[length:]
        return time.perf_counter() - t0


def http(port: int, key: str, model: str, n: int, concurrency: int) -> tuple[list[float], float]:
    client = RawClient(port, key, model)
    lat = [client.one() for _ in range(n)]
    per = n // concurrency
    clients = [RawClient(port, key, model) for _ in range(concurrency)]
    threads = [threading.Thread(target=lambda c=c: [c.one() for _ in range(per)]) for c in clients]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat, per * concurrency / (time.perf_counter() - t0)


def start_server(settings: Settings, engine):
    import uvicorn

    app = create_app(settings, engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return server, thread, sock.getsockname()[1]


def model_dir(name: str, tmp: Path) -> str:
    if name != "tiny":
        return name
    from tests.helpers.tiny_models import build_tiny_model_dir

    return str(build_tiny_model_dir(tmp / "tiny", "llama"))


def summarize(label: str, lat: list[float], rps: float) -> dict:
    p50, p99 = percentile(lat, 50) * 1e3, percentile(lat, 99) * 1e3
    print(f"  {label:8} latency p50 {p50:7.3f} ms  p99 {p99:7.3f} ms   throughput {rps:8.1f} req/s")
    return {"p50": p50, "p99": p99, "rps": rps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny (random 2-layer Llama), default (SmolLM2) or a folder")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="alternating direct/http rounds")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench_gateway_"))
    config = EngineConfig(model=ModelConfig(model=model_dir(args.model, tmp), dtype=args.dtype, max_model_len=512),
                          cache=CacheConfig(num_blocks=256), num_threads=args.threads)
    settings = Settings(engine=config, data_dir=tmp / "data", auth=AuthConfig(last_used_flush_seconds=5))
    migrate(settings.db_url)
    db = Database(settings.db_url)
    create_tenant(db, "bench")
    key = create_key(db, "bench")
    engine = build_engine(settings)
    server, server_thread, port = start_server(settings, engine)
    n, c = args.requests, args.concurrency
    print(f"model {settings.model_name}, {args.rounds} rounds x {n} one-token completions per path, "
          f"concurrency {c}, torch threads {args.threads}")
    asyncio.run(direct(engine, 50, 2))  # warm-up both paths
    http(port, key, settings.model_name, 50, 2)

    # Alternate the paths over several rounds: on a shared machine, load drifts.
    a_lat, b_lat, a_rps, b_rps, cpu = [], [], [], [], []
    for _ in range(args.rounds):
        lat, rps = asyncio.run(direct(engine, n, c))
        a_lat += lat
        a_rps.append(rps)
        cpu0 = thread_cpu(server_thread)
        lat, rps = http(port, key, settings.model_name, n, c)
        cpu.append((thread_cpu(server_thread) - cpu0) / (n + (n // c) * c) * 1e3)
        b_lat += lat
        b_rps.append(rps)
    a = summarize("direct", a_lat, percentile(a_rps, 50))
    b = summarize("http", b_lat, percentile(b_rps, 50))
    print(f"  added latency (http - direct): p50 {b['p50'] - a['p50']:.3f} ms   p99 {b['p99'] - a['p99']:.3f} ms")
    print(f"  throughput ratio http/direct (median of {args.rounds} rounds): {b['rps'] / a['rps']:.3f}   "
          f"latency ratio p50 http/direct: {b['p50'] / a['p50']:.2f}")
    print(f"  gateway (uvicorn thread) CPU per request: {percentile(cpu, 50):.3f} ms (median of rounds)")
    server.should_exit = True
    server_thread.join(10)
    engine.shutdown()


if __name__ == "__main__":
    main()
