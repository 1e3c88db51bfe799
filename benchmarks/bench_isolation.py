"""Cost isolation: tenant B's streaming latency while others attack a real `loraplex serve`.

Starts `loraplex serve` (tiny random Llama by default, `--model default` for SmolLM2) with
tenants A and B. No loopback address is a trusted proxy, so 127.0.0.1 (B's address),
127.0.0.2 (the /health prober) and 127.0.0.3 (a keyless attacker) are clients of their
own. B streams chat completions back to back with the official openai client while, in
turn, for `--seconds` each:

  junk keys     a client floods well-formed unknown keys from B's own address
  slow bodies   200 sockets with no key trickling a declared body a byte a second
  json_schema   A sends a huge response_format json_schema (about 3 MiB)
  costly schemas  A sends schemas within every cap that take seconds each to compile
                (900 bounded strings, each schema new), four at a time
  logit_bias    A sends n=64 with a logit_bias table over the whole vocabulary
  tools         A sends a 3.5 MiB tools list
  (A's big bodies soon get 429 from its request body budget, `--max-body-rate`)
  slow reader   A holds 4 long streams and reads each a few bytes a second
  read streams  (a control, not an attack) the same 4 streams read as fast as they come:
                what A's streams cost B while they run, before the slow reader's pause

Each attacker runs in a process of its own (no share of this process's GIL), at the
lowest CPU priority, so that on a small machine B loses what the server spends on the
attack rather than the CPU the attacking client burns. Printed:
B's TTFT (per request) and TPOT (every gap between two streamed tokens, so the p99 has
samples even when a phase holds few requests) p50/p99 per phase as ratios to B alone in
the phases just before and after it (B alone runs between attacks), /health
p50/p99 per phase, and what the attack got (HTTP statuses, connections closed by the
server): a refused attack is a successful defence. Nothing is asserted
(tests/e2e/isolation/ asserts the properties).

    python benchmarks/bench_isolation.py [--seconds 20] [--model tiny|default|PATH]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from workload import percentile  # noqa: E402

B_ADDRESS, PROBE_ADDRESS, KEYLESS_ADDRESS = "127.0.0.1", "127.0.0.2", "127.0.0.3"


@dataclass
class Target:
    url: str
    port: int
    model: str
    keys: dict[str, str]
    vocab: int = 49152
    max_model_len: int = 2048


class Server:
    """`loraplex serve` on a free port with tenants A and B (and nothing trusted as a proxy)."""

    def __init__(self, model: str, tmp: Path, extra: list[str]) -> None:
        from loraplex.platform.db.database import Database, migrate
        from loraplex.platform.tenancy.tenants import create_key, create_tenant

        url = f"sqlite:///{tmp / 'db.sqlite'}"
        migrate(url)
        db = Database(url)
        keys = {}
        for tenant in ("A", "B"):
            create_tenant(db, tenant.lower(), "standard")
            keys[tenant] = create_key(db, tenant.lower())
        db.dispose()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-c", "from loraplex.platform.cli.main import main; main()", "serve", "--model", model,
               "--data-dir", str(tmp / "data"), "--database-url", url, "--no-demo", "--port", str(port),
               "--metrics-port", "0", "--forwarded-allow-ips", "192.0.2.1", *extra]
        self.log = open(tmp / "serve.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.target = Target(f"http://127.0.0.1:{port}", port, "", keys)
        self._wait()

    def _wait(self) -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"bench_isolation: serve exited:\n{self.log.read()[-3000:]}")
            try:
                r = httpx.get(f"{self.target.url}/v1/models", timeout=5,
                              headers={"Authorization": f"Bearer {self.target.keys['B']}"})
                if r.status_code == 200:
                    card = r.json()["data"][0]
                    self.target.model, self.target.max_model_len = card["id"], card["max_model_len"]
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise SystemExit("bench_isolation: serve did not come up in time")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# -- what B and the prober measure -------------------------------------------------------
@dataclass
class Samples:
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    health: list[float] = field(default_factory=list)
    health_errors: Counter = field(default_factory=Counter)


def stream_b(t: Target, tokens: int, stop: threading.Event, phase: list[Samples]) -> None:
    """B's steady stream: one chat completion after another, each timed token by token."""
    import openai

    client = openai.OpenAI(base_url=f"{t.url}/v1", api_key=t.keys["B"], max_retries=0, timeout=300,
                           http_client=httpx.Client(transport=httpx.HTTPTransport(local_address=B_ADDRESS)))
    i = 0
    while not stop.is_set():
        i += 1
        sink = phase[-1]
        t0, stamps = time.perf_counter(), []
        try:
            stream = client.chat.completions.create(
                model=t.model, stream=True, max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": f"Count slowly from {i} upwards."}])
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(time.perf_counter())
        except Exception as exc:  # noqa: BLE001 - counted, never fatal: B must keep streaming
            sink.errors[type(exc).__name__] += 1
            continue
        if not stamps:
            continue
        # Counted in the phase it started in (one that ends mid-request ran mostly under it).
        sink.ttft.append(stamps[0] - t0)
        sink.tpot.extend(b - a for a, b in zip(stamps, stamps[1:]))


def probe_health(t: Target, stop: threading.Event, phase: list[Samples], interval: float = 0.05) -> None:
    with httpx.Client(timeout=60, transport=httpx.HTTPTransport(local_address=PROBE_ADDRESS)) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                status = client.get(f"{t.url}/health").status_code
            except httpx.HTTPError as exc:
                phase[-1].health_errors[type(exc).__name__] += 1
                continue
            dt = time.perf_counter() - t0
            if status == 200:
                phase[-1].health.append(dt)
            else:
                phase[-1].health_errors[str(status)] += 1
            time.sleep(max(0.0, interval - dt))


# -- the attacks (each runs in a process of its own) -------------------------------------
def _post(client: httpx.Client, t: Target, body: bytes, got: Counter) -> None:
    try:
        r = client.post(f"{t.url}/v1/chat/completions", content=body, timeout=120,
                        headers={"Authorization": f"Bearer {t.keys['A']}", "Content-Type": "application/json"})
        got[str(r.status_code)] += 1
    except httpx.HTTPError as exc:
        got[type(exc).__name__] += 1


def _repeat(t: Target, body: bytes, stop, got: Counter) -> None:
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.4")) as client:
        while not stop.is_set():
            _post(client, t, body, got)


def junk_keys(t: Target, stop, got: Counter) -> None:
    with httpx.Client(timeout=60, transport=httpx.HTTPTransport(local_address=B_ADDRESS)) as client:
        n = 0
        while not stop.is_set():
            n += 1
            key = f"lpx_{n % 16**12:012x}_" + "x" * 43
            try:
                got[str(client.get(f"{t.url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code)] += 1
            except httpx.HTTPError as exc:
                got[type(exc).__name__] += 1


def _slow_socket(t: Target) -> socket.socket:
    s = socket.socket()
    s.bind((KEYLESS_ADDRESS, 0))
    s.connect(("127.0.0.1", t.port))
    s.setblocking(False)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100000\r\n\r\n")
    return s


def slow_bodies(t: Target, stop, got: Counter, count: int = 200) -> None:
    socks: list[socket.socket] = []
    while not stop.is_set():
        while len(socks) < count:
            try:
                socks.append(_slow_socket(t))
            except OSError as exc:
                got[type(exc).__name__] += 1
                break
        alive = []
        for s in socks:
            try:
                answer = s.recv(4096)
            except BlockingIOError:
                answer = None
            except OSError:
                answer = b""
            if answer is not None:  # the server answered (429 over the cap) or closed it
                got["answered " + answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "closed"] += 1
                s.close()
                continue
            try:
                s.send(b" ")
                alive.append(s)
            except OSError:
                got["closed"] += 1
                s.close()
        socks = alive
        stop.wait(1.0)
    for s in socks:
        s.close()


def _schema(target_bytes: int) -> dict:
    props, i, size = {}, 0, 0
    while size < target_bytes:  # sized as it grows: measuring the whole each time is quadratic
        props[f"field_{i}"] = field = {"type": "object", "properties": {
            "v": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 13 + 9}}}$"},
            "k": {"enum": [f"choice_{i}_{j}" for j in range(20)]}}, "required": ["v", "k"]}
        size += len(json.dumps(field)) + len(f"field_{i}") + 4
        i += 1
    return {"type": "object", "properties": props, "required": list(props)}


def json_schema(t: Target, stop, got: Counter) -> None:
    body = json.dumps({"model": t.model, "max_tokens": 8, "messages": [{"role": "user", "content": "json"}],
                       "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "huge", "schema": _schema(3 << 20)}}}).encode()
    _repeat(t, body, stop, got)


def costly_schemas(t: Target, stop, got: Counter, senders: int = 4) -> None:
    """Schemas within every cap that take seconds each to compile (900 bounded strings):
    each distinct, so no cache answers, from `senders` at once (A's whole compile share)."""

    def send(n: int) -> None:
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.4")) as client:
            while not stop.is_set():
                n += senders
                schema = {"type": "object", "properties": {f"f{n}_{i}": {"type": "string", "maxLength": 200}
                                                           for i in range(900)}}
                body = json.dumps({"model": t.model, "max_tokens": 8, "messages": [{"role": "user", "content": "json"}],
                                   "response_format": {"type": "json_schema",
                                                       "json_schema": {"name": "costly", "schema": schema}}}).encode()
                _post(client, t, body, got)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(senders)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def logit_bias(t: Target, stop, got: Counter) -> None:
    bias = {str(i): (i % 200) / 100 - 1 for i in range(t.vocab)}
    body = json.dumps({"model": t.model, "max_tokens": 16, "n": 64, "logit_bias": bias,
                       "messages": [{"role": "user", "content": "bias"}]}).encode()
    _repeat(t, body, stop, got)


def tools(t: Target, stop, got: Counter) -> None:
    fns, size = [], 0
    while size < int(3.5 * 2**20):
        fn = {"type": "function", "function": {
            "name": f"tool_{len(fns)}", "description": "does a thing " * 20,
            "parameters": {"type": "object", "properties": {f"p{j}": {"type": "string", "description": "x" * 40}
                                                            for j in range(8)}}}}
        size += len(json.dumps(fn))
        fns.append(fn)
    body = json.dumps({"model": t.model, "max_tokens": 8, "tools": fns,
                       "messages": [{"role": "user", "content": "call one"}]}).encode()
    _repeat(t, body, stop, got)


def _long_streams(t: Target, stop, got: Counter, streams: int, read: int, every: float) -> None:
    """`streams` long streams from A, each read `read` bytes at a time every `every` s."""
    body = json.dumps({"model": t.model, "max_tokens": t.max_model_len - 64, "stream": True, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "Write a very long story."}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {t.keys['A']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    socks: list[socket.socket] = []
    while not stop.is_set():
        while len(socks) < streams:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.bind(("127.0.0.4", 0))
            s.connect(("127.0.0.1", t.port))
            s.sendall(head + body)
            first = s.recv(64)
            got[first.split(b" ", 2)[1].decode() if first.startswith(b"HTTP/") else "closed"] += 1
            socks.append(s)
        alive = []
        for s in socks:
            s.settimeout(min(0.2, every) or 0.05)
            try:
                if s.recv(read) == b"":
                    got["stream ended"] += 1
                    s.close()
                    continue
            except socket.timeout:
                pass
            except OSError:
                got["stream reset"] += 1
                s.close()
                continue
            alive.append(s)
        socks = alive
        if every:
            stop.wait(every)
    for s in socks:
        s.close()


def slow_reader(t: Target, stop, got: Counter) -> None:
    _long_streams(t, stop, got, 4, 16, 0.5)


def read_streams(t: Target, stop, got: Counter) -> None:
    """Not an attack: the slow reader's four streams read as fast as they come, what the
    slow reader costs B at most (its streams run like these until they are paused)."""
    _long_streams(t, stop, got, 4, 1 << 16, 0.0)


ATTACKS: dict[str, Callable] = {"junk keys": junk_keys, "slow bodies": slow_bodies, "json_schema": json_schema,
                                "costly schemas": costly_schemas, "logit_bias": logit_bias, "tools": tools,
                                "slow reader": slow_reader, "read streams": read_streams}


def _attack_main(name: str, t: Target, stop, out) -> None:
    """The attack on a thread, reported as soon as `stop` is set (a request still in
    flight then is not waited for beyond a few seconds)."""
    got: Counter = Counter()
    # On a small machine the attacker's own CPU would be most of what B loses; niced,
    # the figures show what the server spends on the attack.
    os.nice(19)

    def attack() -> None:
        try:
            ATTACKS[name](t, stop, got)
        except Exception as exc:  # noqa: BLE001 - reported as what the attack got
            got[f"attacker failed: {type(exc).__name__}: {exc}"[:120]] += 1

    worker = threading.Thread(target=attack, daemon=True)
    worker.start()
    stop.wait()
    worker.join(5)
    out.put(dict(got))


# -- phases and the table ------------------------------------------------------------------
def run(t: Target, attacks: list[str], seconds: float, tokens: int) -> dict:
    """B alone, then each attack followed by B alone again: each attack is compared with
    the B-alone phases on either side of it, so a shared machine whose speed drifts over
    the run moves the attack and its baseline together."""
    ctx = mp.get_context("spawn")
    phases: list[Samples] = [Samples()]
    stop = threading.Event()
    workers = [threading.Thread(target=stream_b, args=(t, tokens, stop, phases)),
               threading.Thread(target=probe_health, args=(t, stop, phases))]
    for w in workers:
        w.start()
    try:
        deadline = time.monotonic() + 600
        while len(phases[0].ttft) < 2 and time.monotonic() < deadline:  # warm up: not measured
            time.sleep(0.1)
        alone = [Samples()]
        phases.append(alone[0])
        results, got, baselines = {}, {"B alone": {}}, {}
        time.sleep(seconds)
        for name in attacks:
            phases.append(Samples())
            results[name] = phases[-1]
            halt, out = ctx.Event(), ctx.Queue()
            proc = ctx.Process(target=_attack_main, args=(name, t, halt, out), daemon=True)
            proc.start()
            time.sleep(seconds)
            halt.set()
            phases.append(Samples())  # the gap while the attack winds down is not measured
            try:
                got[name] = out.get(timeout=max(60.0, seconds * 3))
            except Exception:  # noqa: BLE001 - a stuck attacker is reported, not waited for
                got[name] = {"attacker did not report": 1}
            proc.join(10)
            if proc.is_alive():
                proc.kill()
            alone.append(Samples())
            phases.append(alone[-1])
            time.sleep(seconds)
            baselines[name] = _pooled(alone[-2:])
    finally:
        stop.set()
        for w in workers:
            w.join(300)
    return {"phases": {"B alone": _pooled(alone), **results}, "baselines": baselines, "attack_statuses": got}


def _pooled(phases: list[Samples]) -> Samples:
    out = Samples()
    for s in phases:
        out.ttft += s.ttft
        out.tpot += s.tpot
        out.health += s.health
        out.errors += s.errors
        out.health_errors += s.health_errors
    return out


def _stats(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99)}


def report(out: dict) -> dict:
    phases: dict[str, Samples] = out["phases"]
    rows = {}
    print(f"{'phase':12} {'B req':>5} {'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'p99':>7} "
          f"{'/health p50 ms':>14} {'p99 ms':>7}  what the attack got")
    for name, s in phases.items():
        base = out["baselines"].get(name, phases["B alone"])
        b_ttft, b_tpot = _stats(base.ttft), _stats(base.tpot)
        ttft, tpot, health = _stats(s.ttft), _stats(s.tpot), _stats(s.health)
        row = {"b_requests": len(s.ttft), "b_errors": dict(s.errors),
               "ttft_ratio": {q: ttft[q] / b_ttft[q] for q in ttft},
               "tpot_ratio": {q: tpot[q] / b_tpot[q] for q in tpot},
               "ttft_s": ttft, "tpot_s": tpot, "health_ms": {q: v * 1e3 for q, v in health.items()},
               "health_errors": dict(s.health_errors), "attack": out["attack_statuses"].get(name, {})}
        rows[name] = row
        got = ", ".join(f"{k} x{v}" for k, v in sorted(row["attack"].items())) or "-"
        if s.errors:
            got += f"; B errors {dict(s.errors)}"
        if s.health_errors:
            got += f"; /health errors {dict(s.health_errors)}"
        print(f"{name:12} {len(s.ttft):5d} {row['ttft_ratio']['p50']:8.2f}x {row['ttft_ratio']['p99']:6.2f}x "
              f"{row['tpot_ratio']['p50']:8.2f}x {row['tpot_ratio']['p99']:6.2f}x "
              f"{row['health_ms']['p50']:14.1f} {row['health_ms']['p99']:7.1f}  {got}", flush=True)
    alone = phases["B alone"]
    a_ttft, a_tpot = _stats(alone.ttft), _stats(alone.tpot)
    print(f"B alone (every B-alone phase; each attack is compared with the two beside it): "
          f"TTFT p50 {a_ttft['p50'] * 1e3:.0f} ms p99 {a_ttft['p99'] * 1e3:.0f} ms, "
          f"TPOT p50 {a_tpot['p50'] * 1e3:.1f} ms p99 {a_tpot['p99'] * 1e3:.1f} ms")
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="per phase")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per B request")
    ap.add_argument("--model", default="tiny", help="tiny (random 2-layer Llama), default (SmolLM2) or a folder")
    ap.add_argument("--only", action="append", choices=list(ATTACKS), help="run only these attacks (repeatable)")
    ap.add_argument("--serve-args", default="--threads 1", help="extra `loraplex serve` arguments")
    args = ap.parse_args(argv)
    attacks = [k for k in ATTACKS if not args.only or k in args.only]
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        model = args.model
        if model == "tiny":
            from tests.helpers.tiny_models import build_tiny_model_dir

            model = str(build_tiny_model_dir(tmp / "tiny", "llama"))
        elif model == "default":
            from loraplex.engine.config import DEFAULT_MODEL

            model = DEFAULT_MODEL
        srv = Server(model, tmp, args.serve_args.split())
        try:
            srv.target.vocab = _vocab(model)
            rows = report(run(srv.target, attacks, args.seconds, args.tokens))
        finally:
            srv.stop()
    return rows


def _vocab(model: str) -> int:
    try:
        return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    except (OSError, KeyError, ValueError):
        return 49152


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
