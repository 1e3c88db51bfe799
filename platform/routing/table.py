"""The fleet's state in memory: membership, health, stats, in-flight counts, residency.

Pure bookkeeping, no I/O: the pool and the health poller feed it, policies read it.
A residency index (adapter -> workers holding it) keeps a routing decision from
scanning every worker.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from loraplex.platform.routing.view import Residency, WorkerStats, WorkerView


@dataclass
class _Worker:
    url: str
    stats: WorkerStats = field(default_factory=WorkerStats)
    healthy: bool = True
    failures: int = 0
    in_flight: int = 0
    held: dict[str, Residency] = field(default_factory=dict)


def _accepts(w: _Worker) -> bool:
    return w.healthy and w.stats.ready and not w.stats.draining


class Fleet:
    """Workers keyed by id (their URL). `version` changes whenever membership does;
    `n_accepting` and `accepting_in_flight` count the workers that may get new requests
    and the requests in flight on them."""

    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        self._holders: dict[str, dict[str, Residency]] = {}
        self.members: tuple[str, ...] = ()
        self.version = 0
        self.total_in_flight = 0
        self.n_accepting = 0
        self.accepting_in_flight = 0

    # -- membership -----------------------------------------------------------------
    def set_members(self, urls: Iterable[str]) -> tuple[list[str], list[str]]:
        """Make the fleet exactly `urls`; returns (added, removed). New workers start
        healthy and empty; a removed worker's in-flight requests finish uncounted."""
        wanted = set(urls)
        added = sorted(wanted - self._workers.keys())
        removed = sorted(self._workers.keys() - wanted)
        for wid in removed:
            self._set_held(wid, {})
            self._count(self._workers[wid], -1)
            self.total_in_flight -= self._workers.pop(wid).in_flight
        for wid in added:
            self._workers[wid] = _Worker(url=wid)
            self._count(self._workers[wid], 1)
        if added or removed:
            self.members = tuple(sorted(self._workers))
            self.version += 1
        return added, removed

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    # -- reports --------------------------------------------------------------------
    def update_stats(self, worker_id: str, stats: WorkerStats) -> None:
        w = self._workers.get(worker_id)
        if w is None:
            return  # a late report from a worker that left
        self._count(w, -1)
        w.stats = stats
        self._count(w, 1)
        held = {a: Residency.CPU for a in stats.cpu_adapters}
        held.update((a, Residency.DEVICE) for a in stats.device_adapters)
        self._set_held(worker_id, held)

    def record_health(self, worker_id: str, ok: bool, failure_threshold: int) -> None:
        """One health-check result: a success rejoins at once, `failure_threshold`
        failures in a row make the worker leave."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        self._count(w, -1)
        if ok:
            w.failures, w.healthy = 0, True
        else:
            w.failures += 1
            if w.failures >= failure_threshold:
                w.healthy = False
        self._count(w, 1)

    def mark_down(self, worker_id: str) -> None:
        """A request found the worker dead: it leaves until a health check succeeds."""
        w = self._workers.get(worker_id)
        if w is not None:
            self._count(w, -1)
            w.healthy = False
            self._count(w, 1)

    # -- dispatch bookkeeping -------------------------------------------------------
    def begin(self, worker_id: str, adapter: str | None) -> None:
        w = self._workers[worker_id]
        w.in_flight += 1
        self.total_in_flight += 1
        self.accepting_in_flight += _accepts(w)
        if adapter is not None and w.held.get(adapter) != Residency.DEVICE:
            # The worker will load it for this request: count it as resident until its
            # next report says otherwise, so the next request for it goes there too.
            held = dict(w.held)
            held[adapter] = Residency.DEVICE
            self._set_held(worker_id, held)

    def end(self, worker_id: str) -> None:
        w = self._workers.get(worker_id)
        if w is not None:
            assert w.in_flight > 0, f"in-flight count of {worker_id} went negative"
            w.in_flight -= 1
            self.total_in_flight -= 1
            self.accepting_in_flight -= _accepts(w)

    # -- reads (policies) -----------------------------------------------------------
    def accepting(self, worker_id: str) -> bool:
        return _accepts(self._workers[worker_id])

    def in_flight(self, worker_id: str) -> int:
        return self._workers[worker_id].in_flight

    def stats(self, worker_id: str) -> WorkerStats:
        return self._workers[worker_id].stats

    def holders(self, adapter: str) -> dict[str, Residency]:
        """Workers holding `adapter` (reported, or just sent a request for it) -> tier."""
        return self._holders.get(adapter, {})

    def residency(self, worker_id: str, adapter: str) -> Residency:
        return self._workers[worker_id].held.get(adapter, Residency.ABSENT)

    def accepting_ids(self) -> list[str]:
        return [wid for wid in self.members if self.accepting(wid)]

    def view(self, worker_id: str) -> WorkerView:
        w = self._workers[worker_id]
        return WorkerView(worker_id, w.url, w.healthy, w.in_flight, w.stats)

    def views(self) -> list[WorkerView]:
        return [self.view(wid) for wid in self.members]

    def _count(self, w: _Worker, sign: int) -> None:
        """Add (sign 1) or take out (sign -1) `w` from the accepting counts."""
        if _accepts(w):
            self.n_accepting += sign
            self.accepting_in_flight += sign * w.in_flight

    def _set_held(self, worker_id: str, held: dict[str, Residency]) -> None:
        w = self._workers[worker_id]
        for a in w.held.keys() - held.keys():
            hs = self._holders[a]
            del hs[worker_id]
            if not hs:
                del self._holders[a]
        for a, tier in held.items():
            self._holders.setdefault(a, {})[worker_id] = tier
        w.held = held
