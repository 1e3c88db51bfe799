"""Adapter affinity with bounded loads, residency scoring, tie-breaks, prefixes, round-robin."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.platform.routing import RouteRequest, WorkerStats
from tests.platform.routing.conftest import pool_of, urls

HOT = RouteRequest(adapter="hot")


def home_of(pool, request: RouteRequest) -> str:
    """Where `request` goes on an idle fleet that holds nothing (then undone)."""
    lease = pool.acquire(request)
    pool.release(lease, WorkerStats())
    return lease.worker_id


def test_an_adapter_has_one_home_behind_every_gateway():
    gateways = [pool_of(8), pool_of(8)]
    for adapter in (f"adapter-{i}" for i in range(20)):
        req = RouteRequest(adapter=adapter)
        homes = {home_of(g, req) for g in gateways for _ in range(3)}
        assert len(homes) == 1, adapter


def test_adapters_spread_over_the_fleet():
    pool = pool_of(8)
    homes = Counter(home_of(pool, RouteRequest(adapter=f"adapter-{i}")) for i in range(400))
    assert set(homes) == set(urls(8))
    assert max(homes.values()) < 2 * 400 / 8


def test_hot_adapter_stays_home_until_the_bound_then_spills():
    pool = pool_of(4, epsilon=0.25)
    home = home_of(pool, HOT)
    for i in range(40):
        bound = pool.policy.bound(pool.fleet)
        lease = pool.acquire(HOT)
        assert pool.fleet.in_flight(lease.worker_id) <= bound
    loads = {v.worker_id: v.in_flight for v in pool.workers()}
    assert loads[home] == max(loads.values()) <= math.ceil(1.25 * 40 / 4)
    assert sum(n > 0 for n in loads.values()) > 1  # it spilled


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), epsilon=st.sampled_from([0.05, 0.2, 0.5, 1.0]),
       ops=st.lists(st.tuples(st.sampled_from(["go", "go", "go", "done", "stats", "down", "up"]),
                              st.integers(0, 5), st.integers(0, 10**6)), max_size=200))
def test_no_worker_ever_takes_more_than_the_bound(n, epsilon, ops):
    pool = pool_of(n, epsilon=epsilon)
    leases = []
    for op, adapter, pick in ops:
        wid = pool.fleet.members[pick % n]
        if op == "go":
            accepting = pool.fleet.n_accepting
            if accepting == 0:
                continue
            total = sum(v.in_flight for v in pool.workers() if v.accepting)
            lease = pool.acquire(RouteRequest(adapter=f"a{adapter}" if adapter else None))
            view = pool.fleet.view(lease.worker_id)
            assert view.accepting
            assert view.in_flight <= math.ceil((1 + epsilon) * (total + 1) / accepting)
            leases.append(lease)
        elif op == "done" and leases:
            pool.release(leases.pop(pick % len(leases)))
        elif op == "stats":
            pool.update_stats(wid, WorkerStats(device_adapters=frozenset({f"a{adapter}"}),
                                               cpu_adapters=frozenset({f"a{(adapter + 1) % 6}"})))
        elif op in ("down", "up"):
            pool.record_health(wid, WorkerStats() if op == "up" else None)
            pool.record_health(wid, WorkerStats() if op == "up" else None)
    assert pool.fleet.total_in_flight == len(leases) == pool.in_flight
    views = pool.workers()
    assert pool.fleet.accepting_in_flight == sum(v.in_flight for v in views if v.accepting)
    assert pool.fleet.n_accepting == sum(v.accepting for v in views)


def test_device_slot_beats_cpu_tier_beats_loading():
    pool = pool_of(6)
    home = home_of(pool, HOT)
    cpu_holder, device_holder = [w for w in urls(6) if w != home][:2]
    pool.update_stats(home, WorkerStats())  # forget the home's optimistic residency
    pool.update_stats(cpu_holder, WorkerStats(cpu_adapters=frozenset({"hot"})))
    assert home_of(pool, HOT) == cpu_holder
    pool.update_stats(cpu_holder, WorkerStats(cpu_adapters=frozenset({"hot"})))
    pool.update_stats(device_holder, WorkerStats(device_adapters=frozenset({"hot"})))
    assert home_of(pool, HOT) == device_holder
    pool.update_stats(device_holder, WorkerStats(device_adapters=frozenset({"hot"}), draining=True))
    assert home_of(pool, HOT) == cpu_holder


def test_queue_depth_then_kv_usage_break_ties():
    pool = pool_of(4)
    a, b = urls(4)[:2]
    holds = frozenset({"hot"})
    pool.update_stats(a, WorkerStats(device_adapters=holds, waiting={"standard": 3}))
    pool.update_stats(b, WorkerStats(device_adapters=holds, waiting={"standard": 1}, kv_usage=0.9))
    assert home_of(pool, HOT) == b
    pool.update_stats(a, WorkerStats(device_adapters=holds, waiting={"standard": 1}, kv_usage=0.2))
    pool.update_stats(b, WorkerStats(device_adapters=holds, waiting={"standard": 1}, kv_usage=0.9))
    assert home_of(pool, HOT) == a


def test_a_repeated_prefix_returns_to_its_worker_while_load_allows():
    pool = pool_of(4, epsilon=0.5)
    req = RouteRequest(adapter="hot", prefix_key="tenant-1:abc")
    first = home_of(pool, req)
    other = next(w for w in urls(4) if w != first)
    pool.update_stats(first, WorkerStats())  # the adapter left its slots...
    pool.update_stats(other, WorkerStats(device_adapters=frozenset({"hot"})))  # ...and sits elsewhere
    assert home_of(pool, req) == first  # the cached prefix wins
    assert home_of(pool, RouteRequest(adapter="hot")) == other  # without a prefix: residency
    held = [pool.acquire(RouteRequest(adapter=f"x{i}")) for i in range(8)]
    while pool.fleet.in_flight(first) < pool.policy.bound(pool.fleet):
        held.append(pool.acquire(req))
    assert pool.acquire(req).worker_id != first  # over the bound: the prefix yields


def test_workers_report_prefixes_they_served():
    pool = pool_of(4)
    target = urls(4)[2]
    pool.update_stats(target, WorkerStats(prefix_keys=("k",)))
    assert home_of(pool, RouteRequest(prefix_key="k")) == target


def test_base_model_requests_go_to_the_least_loaded():
    pool = pool_of(5)
    for _ in range(23):
        pool.acquire(RouteRequest())
        loads = [v.in_flight for v in pool.workers()]
        assert max(loads) - min(loads) <= 1


def test_round_robin_cycles_over_accepting_workers():
    pool = pool_of(4, policy="round_robin")
    ws = urls(4)
    pool.update_stats(ws[1], WorkerStats(draining=True))
    got = [pool.acquire(HOT).worker_id for _ in range(6)]
    assert got == [ws[0], ws[2], ws[3], ws[0], ws[2], ws[3]]


def test_homes_agree_across_processes_whatever_their_hash_seed():
    """Gateway replicas are separate processes: the ring must not use Python's salted hash."""
    script = ("from loraplex.platform.routing import RouteRequest, RouterConfig, WorkerPool\n"
              "pool = WorkerPool(RouterConfig())\n"
              f"pool.set_members({urls(8)!r})\n"
              "print(' '.join(pool.acquire(RouteRequest(adapter=f'adapter-{i}')).worker_id for i in range(30)))\n")
    homes = set()
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONHASHSEED": seed},
                             capture_output=True, text=True, check=True)
        homes.add(out.stdout)
    assert len(homes) == 1
