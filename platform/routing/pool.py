"""The worker pool: the fleet's state plus the chosen policy, as the gateway calls it.

    lease = pool.acquire(RouteRequest(adapter=digest, prefix_key=key))  # NoCapacityError -> 503
    try:   ... send to lease.url ...
    except WorkerUnreachable:             # before any token was sent
        lease = pool.retry(lease)         # once, on another worker
    finally:
        pool.release(lease, stats)        # stats carried on the response, if any

Every method is synchronous and does no I/O; call them from the event loop thread.
A worker's id is its URL. In-flight counts are this gateway's own (what it sent and
has not finished), so each gateway replica bounds its share; the workers' stats carry
their whole queues, which break ties.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from loraplex.platform.routing.config import RouterConfig
from loraplex.platform.routing.table import Fleet
from loraplex.platform.routing.policy import RoutingPolicy, make_policy
from loraplex.platform.routing.view import RouteRequest, WorkerStats, WorkerView


@dataclass(frozen=True)
class Lease:
    """One request placed on one worker; release it exactly once (extra releases are no-ops)."""

    lease_id: int
    worker_id: str
    url: str
    request: RouteRequest


class WorkerPool:
    def __init__(self, config: RouterConfig | None = None, policy: RoutingPolicy | None = None) -> None:
        self.config = config or RouterConfig()
        self.policy = policy or make_policy(self.config)
        self.fleet = Fleet()
        self._ids = itertools.count(1)
        self._active: dict[int, Lease] = {}

    # -- membership and reports (discovery, health poller, responses) ----------------
    def set_members(self, urls: Iterable[str]) -> tuple[list[str], list[str]]:
        """Make the pool exactly `urls` (from a static list or a DNS answer); (added, removed)."""
        added, removed = self.fleet.set_members(urls)
        gone = set(removed)
        for lid in [lid for lid, lease in self._active.items() if lease.worker_id in gone]:
            del self._active[lid]
        return added, removed

    def update_stats(self, worker_id: str, stats: WorkerStats) -> None:
        """A stats report (polled, or carried on a response); a draining or not-ready
        worker gets no new request from the next decision on."""
        if worker_id in self.fleet:
            self.fleet.update_stats(worker_id, stats)
            self.policy.on_stats(worker_id, stats)

    def record_health(self, worker_id: str, stats: WorkerStats | None) -> None:
        """One health check: `stats` when the worker answered, None when it did not."""
        self.fleet.record_health(worker_id, stats is not None, self.config.failure_threshold)
        if stats is not None:
            self.update_stats(worker_id, stats)

    def workers(self) -> list[WorkerView]:
        return self.fleet.views()

    # -- requests ---------------------------------------------------------------------
    def acquire(self, request: RouteRequest, exclude: frozenset[str] = frozenset()) -> Lease:
        """Place `request`; raises `NoCapacityError` when no worker can take it."""
        wid = self.policy.choose(request, self.fleet, exclude)
        self.fleet.begin(wid, request.adapter)
        self.policy.observe(request, wid)
        lease = Lease(next(self._ids), wid, wid, request)
        self._active[lease.lease_id] = lease
        return lease

    def release(self, lease: Lease, stats: WorkerStats | None = None) -> None:
        """The request finished (any way); `stats` if its response carried them."""
        if self._active.pop(lease.lease_id, None) is not None:
            self.fleet.end(lease.worker_id)
        if stats is not None:
            self.update_stats(lease.worker_id, stats)

    def fail(self, lease: Lease) -> None:
        """The worker could not be reached or died: release, and it leaves the pool until
        a health check succeeds."""
        self.release(lease)
        self.fleet.mark_down(lease.worker_id)

    def retry(self, lease: Lease) -> Lease:
        """`fail(lease)`, then place its request once more on another worker."""
        self.fail(lease)
        return self.acquire(lease.request, exclude=frozenset({lease.worker_id}))

    @property
    def in_flight(self) -> int:
        return len(self._active)
