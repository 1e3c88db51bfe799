"""Scale-out's costs and gains, on real processes over loopback (tiny random Llama by default).

(1) The hop: one-token completions through `serve` (gateway and engine in one process)
    vs through a gateway in front of one `loraplex worker` process (bench_gateway's raw
    keep-alive client, same prompt). Both gateways run in this process, so the gateway
    thread's own CPU per request is measured the same way (its thread CPU clock).
    Prints added latency p50/p99 and the CPU ratio.
(2) Affinity vs round-robin: `--adapters` adapters (Zipf popularity, exponent `--zipf`)
    over 2 worker processes with `--max-loras` device slots each, `--requests` requests
    at `--concurrency`, routed by the gateway's RemoteEngineClient under each policy
    (fresh workers per policy). Prints adapter loads per 1,000 requests (the workers'
    stats, polled) and output tokens/s, and the ratios.

    python benchmarks/bench_scaleout.py            # the full run (minutes)
    python benchmarks/bench_scaleout.py --quick    # seconds: checks the machinery
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from bench_gateway import PROMPT, http, model_dir, start_server, summarize, thread_cpu  # noqa: E402
from workload import percentile  # noqa: E402

from loraplex.engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig  # noqa: E402
from loraplex.engine.request import SamplingParams  # noqa: E402
from loraplex.platform.db.database import Database, migrate  # noqa: E402
from loraplex.platform.fleet.client import RemoteEngineClient  # noqa: E402
from loraplex.platform.fleet.config import FleetConfig  # noqa: E402
from loraplex.platform.tenancy.adapter_directory import AdapterDirectory  # noqa: E402
from loraplex.platform.fleet.model_info import fetch_model_info  # noqa: E402
from loraplex.platform.routing import RouterConfig  # noqa: E402
from loraplex.platform.assembly.engine_factory import build_engine  # noqa: E402
from loraplex.platform.settings import AuthConfig, Settings  # noqa: E402
from loraplex.platform.tenancy.adapter_registry import add_adapter, open_store, shared_blob_store  # noqa: E402
from loraplex.platform.tenancy.tenants import create_key, create_tenant  # noqa: E402
from tests.e2e.fleet import processes as P  # noqa: E402

MAX_MODEL_LEN = 512


def _fleet_config(workers: list[P.Proc], policy: str = "affinity") -> FleetConfig:
    return FleetConfig(workers=",".join(w.url for w in workers), internal_token=P.INTERNAL_TOKEN,
                       router=RouterConfig(policy=policy, health_interval_s=0.5))


def _remote(settings: Settings, workers: list[P.Proc], tmp: Path, policy: str = "affinity"
            ) -> tuple[RemoteEngineClient, Settings]:
    config = _fleet_config(workers, policy)
    served_name, info = fetch_model_info(config, Path(tempfile.mkdtemp(dir=tmp)))
    engine = RemoteEngineClient(config, info, AdapterDirectory(Database(settings.db_url)))
    gw_settings = Settings(engine=EngineConfig(model=ModelConfig(model=str(info.model_dir))),
                           data_dir=settings.data_dir, database_url=settings.database_url,
                           served_model_name=served_name, auth=AuthConfig(last_used_flush_seconds=5))
    return engine, gw_settings


# -- (1) the hop ----------------------------------------------------------------------------
def hop(args, tmp: Path, mdir: str) -> None:
    config = EngineConfig(model=ModelConfig(model=mdir, dtype="float32", max_model_len=MAX_MODEL_LEN),
                          cache=CacheConfig(num_blocks=256), num_threads=1)
    settings = Settings(engine=config, data_dir=tmp / "hop", auth=AuthConfig(last_used_flush_seconds=5))
    migrate(settings.db_url)
    db = Database(settings.db_url)
    create_tenant(db, "bench")
    key = create_key(db, "bench")
    db.dispose()

    worker = P.worker(Path(mdir), settings.db_url, tmp, "hop-worker", "--max-model-len", str(MAX_MODEL_LEN),
                      "--num-kv-blocks", "256").start()
    engine = build_engine(settings)
    serve_server, serve_thread, serve_port = start_server(settings, engine)
    try:
        worker.wait_ready()
        remote, gw_settings = _remote(settings, [worker], tmp)
        gw_server, gw_thread, gw_port = start_server(gw_settings, remote)
        n, c = args.requests, args.concurrency
        name = settings.model_name
        print(f"(1) the hop: {args.rounds} rounds x {n} one-token completions per path, concurrency {c}")
        http(serve_port, key, name, 20, 2)  # warm-up
        http(gw_port, key, name, 20, 2)
        a_lat, b_lat, a_rps, b_rps, a_cpu, b_cpu = [], [], [], [], [], []
        per_round = n + (n // c) * c
        for _ in range(args.rounds):  # alternate: on a shared machine, load drifts
            for port, thread, lat, rps, cpu in ((serve_port, serve_thread, a_lat, a_rps, a_cpu),
                                                (gw_port, gw_thread, b_lat, b_rps, b_cpu)):
                cpu0 = thread_cpu(thread)
                got, r = http(port, key, name, n, c)
                cpu.append((thread_cpu(thread) - cpu0) / per_round * 1e3)
                lat += got
                rps.append(r)
        a = summarize("serve", a_lat, percentile(a_rps, 50))
        b = summarize("gateway", b_lat, percentile(b_rps, 50))
        print(f"  added latency (gateway->worker - serve): p50 {b['p50'] - a['p50']:.3f} ms   "
              f"p99 {b['p99'] - a['p99']:.3f} ms   (p50 ratio {b['p50'] / a['p50']:.2f})")
        print(f"  gateway thread CPU per request: serve {percentile(a_cpu, 50):.3f} ms, gateway "
              f"{percentile(b_cpu, 50):.3f} ms (ratio {percentile(b_cpu, 50) / percentile(a_cpu, 50):.2f}); "
              f"throughput ratio {b['rps'] / a['rps']:.3f}")
        gw_server.should_exit = True
        gw_thread.join(10)
    finally:
        serve_server.should_exit = True
        serve_thread.join(10)
        engine.shutdown()
        worker.stop()


# -- (2) affinity vs round-robin -------------------------------------------------------------
@dataclass
class PolicyRun:
    policy: str
    loads: float
    requests: int
    tokens: int
    seconds: float

    @property
    def loads_per_1000(self) -> float:
        return 1000 * self.loads / self.requests

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def _zipf_choices(n_adapters: int, n: int, exponent: float, seed: int) -> list[int]:
    weights = [1 / (i + 1) ** exponent for i in range(n_adapters)]
    return random.Random(seed).choices(range(n_adapters), weights, k=n)


async def _drive(remote: RemoteEngineClient, names: list[str], picks: list[int], args) -> int:
    await remote.start()
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    prompt = remote.tokenizer.encode(PROMPT)
    queue = list(enumerate(picks))
    tokens = 0

    async def one_worker() -> None:
        nonlocal tokens
        while queue:
            i, pick = queue.pop()
            async for out in remote.generate(prompt, sp, request_id=f"b{i}", adapter=names[pick]):
                tokens += len(out.new_token_ids)

    try:
        await asyncio.gather(*(one_worker() for _ in range(args.concurrency)))
    finally:
        await remote.aclose()
    return tokens


class LoadCounter(threading.Thread):
    """Adapter loads into device slots, counted from each worker's stats polled every
    `interval` s: a digest that enters `device_adapters` is one load. A load shorter than
    the interval could be missed; a request holds its adapter for longer than that."""

    def __init__(self, workers: list[P.Proc], interval: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.urls = [w.url + "/internal/v1/stats" for w in workers]
        self.interval, self.loads = interval, 0
        self._done = threading.Event()

    def run(self) -> None:
        held: dict[str, set[str]] = {u: set() for u in self.urls}
        with httpx.Client(headers={"authorization": f"Bearer {P.INTERNAL_TOKEN}"}, timeout=5) as client:
            while not self._done.is_set():
                for url in self.urls:
                    device = set(client.get(url).json().get("device_adapters", ()))
                    self.loads += len(device - held[url])
                    held[url] = device
                self._done.wait(self.interval)

    def stop(self) -> int:
        self._done.set()
        self.join(10)
        return self.loads


def policy_run(policy: str, settings: Settings, mdir: str, names: list[str], picks: list[int], tmp: Path,
               args) -> PolicyRun:
    flags = ("--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "512", "--max-loras", str(args.max_loras),
             "--max-cpu-loras", str(args.max_cpu_loras), "--max-lora-rank", "8")
    workers = [P.worker(Path(mdir), settings.db_url, tmp, f"{policy}-w{i}", *flags).start() for i in range(2)]
    try:
        for w in workers:
            w.wait_ready()
        remote, _ = _remote(settings, workers, tmp, policy)
        counter = LoadCounter(workers)
        counter.start()
        t0 = time.perf_counter()
        tokens = asyncio.run(_drive(remote, names, picks, args))
        seconds = time.perf_counter() - t0
        return PolicyRun(policy, counter.stop(), len(picks), tokens, seconds)
    finally:
        for w in workers:
            w.stop()


def affinity_vs_round_robin(args, tmp: Path, mdir: str) -> None:
    from loraplex.adapters.synth import make_random_peft_adapter

    settings = Settings(engine=EngineConfig(model=ModelConfig(model=mdir), lora=LoRAConfig(max_lora_rank=8)),
                        data_dir=tmp / "affinity", adapter_store=f"sqlite:///{tmp / 'affinity.db'}",
                        database_url=f"sqlite:///{tmp / 'affinity.db'}")
    migrate(settings.db_url)
    db = Database(settings.db_url)
    store, blobs = open_store(settings), shared_blob_store(settings, db)
    names = [f"a{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        path = make_random_peft_adapter(mdir, tmp / "adapters" / name, rank=8, seed=i, init_scale=0.1)
        add_adapter(db, store, name, path, public=True, blobs=blobs)
    db.dispose()
    picks = _zipf_choices(args.adapters, args.requests_lora, args.zipf, seed=1)
    print(f"(2) {args.adapters} adapters (Zipf {args.zipf}) over 2 workers x {args.max_loras} slots "
          f"({args.max_cpu_loras} in the CPU tier): {len(picks)} requests x {args.max_tokens} tokens, "
          f"concurrency {args.concurrency}")
    runs = [policy_run(p, settings, mdir, names, picks, tmp, args) for p in ("round_robin", "affinity")]
    for r in runs:
        print(f"  {r.policy:12} adapter loads per 1,000 requests {r.loads_per_1000:8.1f}   "
              f"output {r.tok_s:8.1f} tokens/s   ({r.seconds:.1f} s)")
    rr, af = runs
    fewer = f"{rr.loads / af.loads:.1f}x" if af.loads else f"{rr.loads:g} vs 0"
    print(f"  affinity / round-robin: throughput {af.tok_s / rr.tok_s:.2f}x; loads {fewer} fewer")
    floor = 1000 * miss_floor(args.adapters, args.zipf, 2 * args.max_loras)
    bound = f"{rr.loads_per_1000 / floor:.1f}x" if floor else "unbounded"
    print(f"  bound: even the best static placement (the {2 * args.max_loras} most popular adapters pinned "
          f"in the fleet's slots, the rest loaded on each use) loads {floor:.0f} per 1,000 requests, so no "
          f"router can make fewer than round-robin's / {bound}")


def miss_floor(n_adapters: int, exponent: float, slots: int) -> float:
    """The share of requests whose adapter is outside the `slots` most popular ones: what
    a request must load at least, on average, when the fleet holds `slots` adapters."""
    weights = [1 / (i + 1) ** exponent for i in range(n_adapters)]
    return sum(weights[slots:]) / sum(weights)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny (random Llama), default (SmolLM2) or a folder")
    ap.add_argument("--quick", action="store_true", help="a few seconds: check that everything runs")
    ap.add_argument("--requests", type=int, default=300, help="(1) one-token completions per round and path")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--adapters", type=int, default=64)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--max-cpu-loras", type=int, default=16)
    ap.add_argument("--requests-lora", type=int, default=1500, help="(2) requests per policy")
    ap.add_argument("--max-tokens", type=int, default=16, help="(2) output tokens per request")
    ap.add_argument("--only", choices=("hop", "affinity"), default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.rounds, args.concurrency = 20, 1, 2
        args.adapters, args.requests_lora, args.max_tokens, args.max_loras = 6, 24, 2, 2
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench_scaleout_"))
    mdir = model_dir(args.model, tmp)
    if args.only in (None, "hop"):
        hop(args, tmp, mdir)
    if args.only in (None, "affinity"):
        affinity_vs_round_robin(args, tmp, mdir)


if __name__ == "__main__":
    main()
