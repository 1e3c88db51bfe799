"""Routing policies: adapter affinity with bounded load, and round-robin (the baseline)."""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable

from loraplex.platform.routing.config import RouterConfig
from loraplex.platform.routing.errors import NoCapacityError
from loraplex.platform.routing.table import Fleet
from loraplex.platform.routing.ring import HashRing
from loraplex.platform.routing.view import Residency, RouteRequest, WorkerStats


class RoutingPolicy(ABC):
    """Chooses the worker for one request.

    Contract of `choose(request, fleet, exclude)`: return the id of a worker in
    `fleet.members` that is accepting (healthy, ready, not draining), not in `exclude`,
    and below `config.max_in_flight`; raise `NoCapacityError` when there is none. It
    reads only `fleet` and the policy's own memory, never does I/O or awaits, and never
    changes `fleet` (the pool records the dispatch). After each dispatch the pool calls
    `observe(request, worker_id)`; after each stats report, `on_stats(worker_id, stats)`.
    One policy is chosen at start (`make_policy`).
    """

    def __init__(self, config: RouterConfig) -> None:
        self.config = config

    @abstractmethod
    def choose(self, request: RouteRequest, fleet: Fleet, exclude: frozenset[str] = frozenset()) -> str:
        """The worker for `request`; see the class contract."""

    def observe(self, request: RouteRequest, worker_id: str) -> None:
        """`request` was sent to `worker_id`."""

    def on_stats(self, worker_id: str, stats: WorkerStats) -> None:
        """`worker_id` reported `stats`."""

    def _has_room(self, fleet: Fleet, wid: str, exclude: frozenset[str]) -> bool:
        return (wid not in exclude and fleet.accepting(wid)
                and fleet.in_flight(wid) < self.config.max_in_flight)

    def _no_capacity(self, fleet: Fleet) -> NoCapacityError:
        if fleet.n_accepting == 0:
            msg = "no inference worker is available"
        else:
            msg = "every inference worker is at its in-flight limit"
        return NoCapacityError(msg, self.config.retry_after_s)


class RoundRobinPolicy(RoutingPolicy):
    """Each accepting worker in turn, blind to adapters and load."""

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self._next = 0

    def choose(self, request: RouteRequest, fleet: Fleet, exclude: frozenset[str] = frozenset()) -> str:
        members = fleet.members
        for i in range(len(members)):
            wid = members[(self._next + i) % len(members)]
            if self._has_room(fleet, wid, exclude):
                self._next = (self._next + i + 1) % len(members)
                return wid
        raise self._no_capacity(fleet)


class AffinityPolicy(RoutingPolicy):
    """Adapter affinity under consistent hashing with bounded loads (Mirrokni et al.).

    Admissible workers are those with room and below the bound
    ceil((1 + epsilon) * (in flight on accepting workers + 1) / accepting workers):
    no worker is sent a request past it. Candidates: the worker that served the request's prefix,
    the workers holding its adapter, and the first `probe` admissible workers on the
    adapter's ring walk (its home, then spills). The best candidate has a prefix hit,
    then the highest residency (device slot > CPU tier > must load), then the shortest
    queue, fewest in flight, lowest KV usage, earliest on the ring. Base-model
    requests hash their prefix key, or without one go to the least-loaded worker.
    """

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self._ring = HashRing((), config.vnodes)
        self._ring_version = -1
        self._prefixes: OrderedDict[str, str] = OrderedDict()
        self._turn = 0

    def bound(self, fleet: Fleet) -> int:
        """The in-flight count no worker may exceed after the next dispatch: the mean over
        accepting workers (counting the new request), times 1 + epsilon, rounded up."""
        mean = (fleet.accepting_in_flight + 1) / max(fleet.n_accepting, 1)
        return math.ceil((1 + self.config.epsilon) * mean)

    def choose(self, request: RouteRequest, fleet: Fleet, exclude: frozenset[str] = frozenset()) -> str:
        limit = min(self.bound(fleet), self.config.max_in_flight)

        def admissible(wid: str) -> bool:
            return wid not in exclude and fleet.accepting(wid) and fleet.in_flight(wid) < limit

        ranks: dict[str, int] = {}
        owner = self._prefixes.get(request.prefix_key) if request.prefix_key else None
        if owner is not None and owner in fleet and admissible(owner):
            ranks[owner] = -1
        if request.adapter is not None:
            ranks.update((wid, len(fleet.members)) for wid in fleet.holders(request.adapter)
                         if wid not in ranks and admissible(wid))
        key = request.adapter if request.adapter is not None else request.prefix_key
        if key is not None:
            self._walk(key, fleet, admissible, ranks)
        else:
            ranks.update(self._least_loaded(fleet, admissible))
        if not ranks:  # only excluded workers are below the bound: the one with most room
            ranks.update(self._least_loaded(fleet, lambda w: self._has_room(fleet, w, exclude)))
        if not ranks:
            raise self._no_capacity(fleet)
        return max(ranks, key=lambda wid: self._score(request, fleet, wid, owner, ranks[wid]))

    def _walk(self, key: str, fleet: Fleet, admissible: Callable[[str], bool], ranks: dict[str, int]) -> None:
        if self._ring_version != fleet.version:
            self._ring = HashRing(fleet.members, self.config.vnodes)
            self._ring_version = fleet.version
        found = 0
        for rank, wid in enumerate(self._ring.walk(key)):
            if admissible(wid):
                ranks[wid] = min(rank, ranks.get(wid, rank))
                found += 1
                if found == self.config.probe:
                    return

    def _least_loaded(self, fleet: Fleet, ok: Callable[[str], bool]) -> dict[str, int]:
        members = fleet.members
        best, best_load = None, None
        self._turn = (self._turn + 1) % max(len(members), 1)
        for i in range(len(members)):  # start at a rotating offset so ties spread
            wid = members[(self._turn + i) % len(members)]
            if ok(wid):
                load = (fleet.in_flight(wid), fleet.stats(wid).waiting_total)
                if best_load is None or load < best_load:
                    best, best_load = wid, load
        return {} if best is None else {best: 0}

    @staticmethod
    def _score(request: RouteRequest, fleet: Fleet, wid: str, owner: str | None, rank: int):
        stats = fleet.stats(wid)
        tier = fleet.residency(wid, request.adapter) if request.adapter is not None else Residency.ABSENT
        return (wid == owner, tier, -stats.waiting_total, -fleet.in_flight(wid), -stats.kv_usage, -rank)

    def observe(self, request: RouteRequest, worker_id: str) -> None:
        if request.prefix_key is not None:
            self._remember(request.prefix_key, worker_id)

    def on_stats(self, worker_id: str, stats: WorkerStats) -> None:
        for key in stats.prefix_keys:
            self._remember(key, worker_id)

    def _remember(self, key: str, worker_id: str) -> None:
        self._prefixes[key] = worker_id
        self._prefixes.move_to_end(key)
        while len(self._prefixes) > self.config.prefix_entries:
            self._prefixes.popitem(last=False)


def make_policy(config: RouterConfig) -> RoutingPolicy:
    """The policy `config.policy` names."""
    return AffinityPolicy(config) if config.policy == "affinity" else RoundRobinPolicy(config)
