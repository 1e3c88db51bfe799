"""Static and DNS membership, and the health poller's membership and health updates."""
from __future__ import annotations

import asyncio
import socket

import pytest

from loraplex.platform.routing import (
    DiscoveryError,
    DnsDiscovery,
    HealthPoller,
    Residency,
    RouterConfig,
    StaticDiscovery,
    WorkerPool,
    WorkerStats,
    discovery_for,
)


def test_static_list_is_normalized_sorted_and_deduplicated():
    d = StaticDiscovery("http://B:9000/, http://a:9000,http://[::1]:9001,http://a:9000")
    assert d.resolve() == ["http://[::1]:9001", "http://a:9000", "http://b:9000"]


@pytest.mark.parametrize("url, problem", [
    ("a:9000", "http"), ("ftp://a:9000", "http"), ("http://a", "port"), ("http://a:x", "port"),
    ("http://a:9000/v1", "path"),
])
def test_bad_worker_urls_are_named(url, problem):
    with pytest.raises(DiscoveryError, match=problem):
        StaticDiscovery([url])


def test_dns_name_resolves_to_all_its_addresses_with_the_real_resolver():
    urls = DnsDiscovery.parse("localhost:8123").resolve()
    assert urls and set(urls) <= {"http://127.0.0.1:8123", "http://[::1]:8123"}


def test_a_dns_name_that_does_not_resolve_is_a_discovery_error():
    with pytest.raises(DiscoveryError, match="no-such-worker.invalid"):
        DnsDiscovery("no-such-worker.invalid", 8000).resolve()


def test_the_gateway_flags_pick_one_discovery():
    assert discovery_for(workers="http://a:1").resolve() == ["http://a:1"]
    assert isinstance(discovery_for(workers_dns="workers.ns.svc:8000"), DnsDiscovery)
    for both_or_none in ({}, {"workers": "http://a:1", "workers_dns": "w:1"}):
        with pytest.raises(DiscoveryError, match="exactly one"):
            discovery_for(**both_or_none)


@pytest.mark.parametrize("spec", ["workers", "workers:", ":80", "workers:http", "w:0"])
def test_bad_dns_spec_is_named(spec):
    with pytest.raises(DiscoveryError, match="NAME:PORT|1-65535"):
        DnsDiscovery.parse(spec)


class ChangingDns:
    """A resolver whose answer the test sets (a headless Service whose pods come and go);
    an empty answer is a resolution failure."""

    def __init__(self, addrs: list[str]) -> None:
        self.addrs = addrs

    def __call__(self, host, port, type=0):
        if not self.addrs:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                for a in self.addrs]


class Workers:
    """The stats each worker would answer; a missing one refuses the connection."""

    def __init__(self) -> None:
        self.stats: dict[str, WorkerStats] = {}
        self.probed: list[str] = []

    async def probe(self, url: str) -> WorkerStats:
        self.probed.append(url)
        if url not in self.stats:
            raise ConnectionRefusedError(url)
        return self.stats[url]


def poller(dns: ChangingDns, workers: Workers) -> HealthPoller:
    pool = WorkerPool(RouterConfig(dns_interval_s=0.0, failure_threshold=2))
    return HealthPoller(pool, DnsDiscovery("workers.ns.svc", 8000, resolver=dns), workers.probe)


def test_membership_follows_dns_and_health_follows_probes():
    dns, workers = ChangingDns(["10.0.0.1", "10.0.0.2"]), Workers()
    a, b, c = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"
    workers.stats = {a: WorkerStats(device_adapters=frozenset({"x"})), b: WorkerStats()}
    p = poller(dns, workers)

    async def scenario():
        await p.poll_once()
        assert p.pool.fleet.members == (a, b) and sorted(workers.probed) == [a, b]
        assert p.pool.fleet.residency(a, "x") == Residency.DEVICE
        dns.addrs = ["10.0.0.2", "10.0.0.3"]  # a scaled down, c scheduled
        workers.stats[c] = WorkerStats()
        await p.poll_once()
        assert p.pool.fleet.members == (b, c)
        dns.addrs = []  # a DNS blip keeps the last membership
        await p.poll_once()
        assert p.pool.fleet.members == (b, c)
        del workers.stats[c]  # c dies: leaves after two failed checks, rejoins when back
        await p.poll_once()
        assert p.pool.fleet.accepting(c)
        await p.poll_once()
        assert not p.pool.fleet.accepting(c) and p.pool.fleet.n_accepting == 1
        workers.stats[c] = WorkerStats(draining=True)  # back, but draining
        await p.poll_once()
        assert p.pool.fleet.view(c).healthy and not p.pool.fleet.accepting(c)
        workers.stats[c] = WorkerStats()
        await p.poll_once()
        assert p.pool.fleet.accepting(c)

    asyncio.run(scenario())


def test_a_probe_that_hangs_or_answers_garbage_counts_as_a_failed_check():
    dns, workers = ChangingDns(["10.0.0.1"]), Workers()
    url = "http://10.0.0.1:8000"

    async def hang(_url: str) -> WorkerStats:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def garbled(_url: str) -> WorkerStats:
        return WorkerStats.from_json({"running": "many"})

    pool = WorkerPool(RouterConfig(health_timeout_s=0.01, failure_threshold=1))
    p = HealthPoller(pool, DnsDiscovery("w", 8000, resolver=dns), hang)

    async def scenario():
        await p.poll_once()
        assert pool.fleet.members == (url,) and not pool.fleet.view(url).healthy
        pool.record_health(url, WorkerStats())
        p.probe = garbled  # answers, but not with stats: a failed check too
        await p.poll_once()
        assert not pool.fleet.view(url).healthy
        p.probe = workers.probe
        workers.stats[url] = WorkerStats()
        await p.poll_once()
        assert pool.fleet.view(url).healthy

    asyncio.run(scenario())


def test_run_polls_until_cancelled():
    dns, workers = ChangingDns(["10.0.0.1"]), Workers()
    workers.stats["http://10.0.0.1:8000"] = WorkerStats()
    pool = WorkerPool(RouterConfig(health_interval_s=0.001))
    p = HealthPoller(pool, DnsDiscovery("w", 8000, resolver=dns), workers.probe)

    async def scenario():
        task = asyncio.create_task(p.run())
        while len(workers.probed) < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
