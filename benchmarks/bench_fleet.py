"""Fleet simulation: the router against simulated workers (no model), affinity vs round-robin.

The real `WorkerPool` places every request; the workers are a cost model:
  - `max_loras` device slots over a CPU tier of `cpu_loras` (LRU), with the engine's
    rules: a running request pins its adapter; an adapter not in a device slot costs a
    load (from the CPU tier: `--cpu-load-s`, else from the store: `--store-load-s`) into
    a free or least-recently-used unpinned slot, and its request waits while all are pinned;
  - a request's service time is prefill + decode per token (heavy-tailed lengths from
    workload.py's shape), slowed in proportion once more than `--batch` run at once;
  - each response carries the worker's stats (residency, running, waiting), as a real one does.
Arrivals are Poisson at a rate that keeps `--inflight` requests per worker on average;
adapters are Zipf-popular (exponent `--zipf`). The first `--warmup` of the requests
fill the slots and are not counted.

Prints, per (workers, adapters): adapter loads per 1,000 requests, load imbalance
(max / mean in-flight over workers, running + waiting, sampled at arrivals: mean and
p99) and mean request latency under both policies, with ratios round-robin / affinity.

    python benchmarks/bench_fleet.py            # 8-64 workers x 100-1,000 adapters
    python benchmarks/bench_fleet.py --full     # 8-256 workers x 100-10,000 adapters
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loraplex.platform.routing import (  # noqa: E402
    Lease,
    RouteRequest,
    RouterConfig,
    WorkerPool,
    WorkerStats,
    stable_hash,
)


@dataclass(frozen=True)
class SimConfig:
    workers: int
    adapters: int
    requests: int
    max_loras: int = 8
    cpu_loras: int = 32
    inflight: float = 32.0  # mean requests in flight per worker
    batch: int = 64
    zipf: float = 1.0
    store_load_s: float = 0.4
    cpu_load_s: float = 0.05
    prefill_s_per_token: float = 0.0002
    decode_s_per_token: float = 0.02
    warmup: float = 0.3
    seed: int = 0


@dataclass(frozen=True)
class Job:
    arrival: float
    seq: int
    adapter: str
    prompt: int
    out: int
    lease: Lease


class SimWorker:
    """The engine's slot rules: an adapter a running request uses is pinned; a new one takes
    a free or least-recently-used unpinned slot, and waits while every slot is pinned."""

    def __init__(self, url: str, cfg: SimConfig) -> None:
        self.url, self.cfg = url, cfg
        self.device: OrderedDict[str, None] = OrderedDict()  # resident, least recent first
        self.pins: dict[str, int] = {}  # resident adapter -> running requests using it
        self.cpu: OrderedDict[str, None] = OrderedDict()
        self.queue: list[Job] = []
        self.running = 0
        self.loads = 0  # into a device slot, from either tier
        self.fetches = 0  # from the store: held in neither tier

    @property
    def in_flight(self) -> int:
        return self.running + len(self.queue)

    def submit(self, job: Job) -> float | None:
        """Service time if it starts now, None if it waits for a slot."""
        service = self._start(job)
        if service is None:
            self.queue.append(job)
        return service

    def finish(self, job: Job) -> list[tuple[Job, float]]:
        """`job` ended: unpin its adapter; the waiting jobs that start now, with service times."""
        self.running -= 1
        self.pins[job.adapter] -= 1
        if not self.pins[job.adapter]:
            del self.pins[job.adapter]
        started, waiting = [], []
        for queued in self.queue:
            service = self._start(queued)
            if service is None:
                waiting.append(queued)
            else:
                started.append((queued, service))
        self.queue = waiting
        return started

    def _start(self, job: Job) -> float | None:
        load_s = self._pin(job.adapter)
        if load_s is None:
            return None
        self.running += 1
        c = self.cfg
        slowdown = max(1.0, self.running / c.batch)
        return load_s + (job.prompt * c.prefill_s_per_token + job.out * c.decode_s_per_token) * slowdown

    def _pin(self, adapter: str) -> float | None:
        """Seconds to make `adapter` resident (0 if it is); None while every slot is pinned."""
        load_s = 0.0
        if adapter in self.device:
            self.device.move_to_end(adapter)
        else:
            if len(self.device) >= self.cfg.max_loras:
                victim = next((a for a in self.device if a not in self.pins), None)
                if victim is None:
                    return None
                del self.device[victim]
                self.cpu[victim] = None
                if len(self.cpu) > self.cfg.cpu_loras:
                    self.cpu.popitem(last=False)
            self.loads += 1
            if self.cpu.pop(adapter, 0) is None:
                load_s = self.cfg.cpu_load_s
            else:
                self.fetches += 1
                load_s = self.cfg.store_load_s
            self.device[adapter] = None
        self.pins[adapter] = self.pins.get(adapter, 0) + 1
        return load_s

    def stats(self) -> WorkerStats:
        return WorkerStats(running=self.running, waiting={"standard": len(self.queue)},
                           device_adapters=frozenset(self.device), cpu_adapters=frozenset(self.cpu),
                           max_loras=self.cfg.max_loras)


def workload(cfg: SimConfig) -> list[tuple[float, str, int, int]]:
    """(arrival time, adapter, prompt tokens, output tokens), seeded: both policies see the same."""
    rng = random.Random(cfg.seed)
    weights = list(itertools.accumulate(1.0 / (i + 1) ** cfg.zipf for i in range(cfg.adapters)))
    names = [f"adapter-{i:05d}" for i in range(cfg.adapters)]
    adapters = rng.choices(names, cum_weights=weights, k=cfg.requests)
    sigma = 0.6
    prompts = [max(4, min(2048, int(rng.lognormvariate(math.log(218) - sigma ** 2 / 2, sigma))))
               for _ in range(cfg.requests)]
    outs = [max(16, min(256, int(rng.lognormvariate(math.log(40), 1.0)))) for _ in range(cfg.requests)]
    mean_service = sum(p * cfg.prefill_s_per_token + o * cfg.decode_s_per_token
                       for p, o in zip(prompts, outs)) / cfg.requests
    rate = cfg.inflight * cfg.workers / mean_service  # Little's law, before load costs
    t, arrivals = 0.0, []
    for a, p, o in zip(adapters, prompts, outs):
        t += rng.expovariate(rate)
        arrivals.append((t, a, p, o))
    return arrivals


@dataclass(frozen=True)
class Result:
    loads_per_1k: float
    fetches_per_1k: float
    imbalance_mean: float
    imbalance_p99: float
    latency_mean_s: float
    route_us: float  # router time per request


def simulate(cfg: SimConfig, router: RouterConfig, arrivals: list[tuple[float, str, int, int]]) -> Result:
    pool = WorkerPool(router)
    workers = {w.url: w for w in (SimWorker(f"http://10.0.{i // 250}.{i % 250 + 1}:8000", cfg)
                                  for i in range(cfg.workers))}
    pool.set_members(workers)
    done: list[tuple[float, int, Job]] = []  # (finish time, seq, job)
    warm = min(int(cfg.warmup * len(arrivals)), len(arrivals) - 1)
    counters = {"loads": 0, "fetches": 0}
    ratios: list[float] = []
    latencies: list[float] = []
    route_s = 0.0
    sample_every = max(1, len(arrivals) // 4000)

    def complete_until(t: float) -> None:
        while done and done[0][0] <= t:
            now, _, job = heapq.heappop(done)
            w = workers[job.lease.worker_id]
            for started, service in w.finish(job):
                heapq.heappush(done, (now + service, started.seq, started))
            pool.release(job.lease, w.stats())  # the stats a response carries
            if job.seq >= warm:
                latencies.append(now - job.arrival)

    for i, (t, adapter, prompt, out) in enumerate(arrivals):
        complete_until(t)
        if i == warm:
            counters = {k: sum(getattr(w, k) for w in workers.values()) for k in counters}
        t0 = time.perf_counter()
        lease = pool.acquire(RouteRequest(adapter=adapter))
        route_s += time.perf_counter() - t0
        job = Job(t, i, adapter, prompt, out, lease)
        service = workers[lease.worker_id].submit(job)
        if service is not None:
            heapq.heappush(done, (t + service, i, job))
        if i >= warm and i % sample_every == 0:
            loads = [w.in_flight for w in workers.values()]
            mean = sum(loads) / len(loads)
            if mean >= 1:
                ratios.append(max(loads) / mean)
    complete_until(math.inf)
    counted = len(arrivals) - warm
    ratios.sort()
    return Result(
        loads_per_1k=1000 * (sum(w.loads for w in workers.values()) - counters["loads"]) / counted,
        fetches_per_1k=1000 * (sum(w.fetches for w in workers.values()) - counters["fetches"]) / counted,
        imbalance_mean=sum(ratios) / len(ratios),
        imbalance_p99=ratios[min(len(ratios) - 1, int(0.99 * len(ratios)))],
        latency_mean_s=sum(latencies) / max(len(latencies), 1),
        route_us=1e6 * route_s / len(arrivals))


def home_only_loads(cfg: SimConfig, arrivals: list[tuple[float, str, int, int]]) -> float:
    """Device loads per 1,000 requests if every adapter ran only on its hashed home worker,
    load ignored: the floor that `max_loras` LRU slots leave to any affinity router."""
    slots = [OrderedDict() for _ in range(cfg.workers)]
    warm = int(cfg.warmup * len(arrivals))
    loads = 0
    for i, (_, adapter, _, _) in enumerate(arrivals):
        lru = slots[stable_hash(adapter) % cfg.workers]
        if adapter in lru:
            lru.move_to_end(adapter)
            continue
        loads += i >= warm
        lru[adapter] = None
        if len(lru) > cfg.max_loras:
            lru.popitem(last=False)
    return 1000 * loads / (len(arrivals) - warm)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:>5.1f}x" if b > 0 else "   inf" if a > 0 else "     -"


HEAD = (f"{'workers':>7} {'adapters':>8} {'requests':>8} | {'loads/1k rr':>11} {'aff':>6} {'rr/aff':>6} "
        f"{'home-only':>9} | {'fetches/1k rr':>13} {'aff':>6} {'rr/aff':>6} | "
        f"{'imbal rr':>8} {'aff':>5} {'p99 aff':>7} | {'latency rr/aff':>14} | {'route us':>8}")


def row(cfg: SimConfig, epsilon: float) -> str:
    arrivals = workload(cfg)
    rr = simulate(cfg, RouterConfig(policy="round_robin", max_in_flight=10**6), arrivals)
    aff = simulate(cfg, RouterConfig(epsilon=epsilon, max_in_flight=10**6), arrivals)
    return (f"{cfg.workers:>7} {cfg.adapters:>8} {cfg.requests:>8} | {rr.loads_per_1k:>11.1f} "
            f"{aff.loads_per_1k:>6.1f} {_ratio(rr.loads_per_1k, aff.loads_per_1k)} "
            f"{home_only_loads(cfg, arrivals):>9.1f} | {rr.fetches_per_1k:>13.1f} {aff.fetches_per_1k:>6.1f} "
            f"{_ratio(rr.fetches_per_1k, aff.fetches_per_1k)} | {rr.imbalance_mean:>8.2f} "
            f"{aff.imbalance_mean:>5.2f} {aff.imbalance_p99:>7.2f} | "
            f"{rr.latency_mean_s / aff.latency_mean_s:>13.2f}x | {aff.route_us:>8.1f}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="8-256 workers x 100-10,000 adapters")
    ap.add_argument("--workers", type=int, nargs="*", help="worker counts (overrides the sweep)")
    ap.add_argument("--adapters", type=int, nargs="*", help="adapter counts (overrides the sweep)")
    ap.add_argument("--requests-per-worker", type=int, default=200)
    ap.add_argument("--min-requests", type=int, default=20000)
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--cpu-loras", type=int, default=32)
    ap.add_argument("--inflight", type=float, default=32.0)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--store-load-s", type=float, default=0.4)
    ap.add_argument("--cpu-load-s", type=float, default=0.05)
    ap.add_argument("--epsilon", type=float, default=RouterConfig().epsilon, help="the router's load slack")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    worker_counts = args.workers or ([8, 32, 128, 256] if args.full else [8, 64])
    adapter_counts = args.adapters or ([100, 1000, 10000] if args.full else [100, 1000])
    print(f"max_loras {args.max_loras}, CPU tier {args.cpu_loras}, {args.inflight:g} in flight per worker, "
          f"Zipf {args.zipf:g}, load {args.store_load_s:g} s from the store / {args.cpu_load_s:g} s "
          f"from CPU; epsilon {args.epsilon:g}")
    print("loads: adapters moved into a device slot (from the CPU tier or the store); fetches: from "
          "the store;\nhome-only: loads if each adapter ran only on its home worker (the LRU floor)")
    print(HEAD)
    print("-" * len(HEAD))
    for n_workers in worker_counts:
        for n_adapters in adapter_counts:
            requests = max(args.min_requests, args.requests_per_worker * n_workers)
            cfg = SimConfig(workers=n_workers, adapters=n_adapters, requests=requests,
                            max_loras=args.max_loras, cpu_loras=args.cpu_loras, inflight=args.inflight,
                            zipf=args.zipf, store_load_s=args.store_load_s, cpu_load_s=args.cpu_load_s,
                            seed=args.seed)
            print(row(cfg, args.epsilon), flush=True)


if __name__ == "__main__":
    main()
