"""Lanes over tenant-fair order: the scheduler's waiting queue when fairness is on.

Lanes keep their meaning (interactive before standard before batch, a waiting request
climbing one lane per `aging_seconds`), and inside each lane a `FairQueue` orders the
tenants by the weighted tokens they were served, not by arrival. Admission is fair
too: a tenant may fill at most its share of the whole waiting queue (scaled by its
weight), so one tenant's flood is refused (`TenantShareExceededError`) before it fills
the queue for the others. Requests without a tenant ("", the engine used directly) are
one tenant for ordering and are not held to a share.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from ..config import SchedulerConfig
from ..errors import TenantShareExceededError
from ..request import Lane, Request
from .fairness import FairnessConfig, FairQueue
from .request_queue import LaneQueue, RequestQueue


class FairLaneQueue(RequestQueue):
    """Order: effective lane (aging as in `LaneQueue`, lifting a lane's fair order up to
    its most aged request), then lane, lowest first, each lane in virtual-token-counter
    order. `charge` bills a tenant's computed tokens to the lane of the request."""

    def __init__(self, aging_seconds: float, clock: Callable[[], float],
                 config: FairnessConfig | None = None) -> None:
        self.aging_seconds = aging_seconds
        self.clock = clock
        self.config = config or FairnessConfig()
        self._lanes = [FairQueue(self.config) for _ in Lane]
        self._queued: dict[str, Request] = {}
        self._per_tenant: dict[str, int] = {}

    # -- admission ------------------------------------------------------------------
    def check(self, req: Request) -> None:
        tenant = req.tenant
        if not tenant:
            return
        waiting, limit = self._per_tenant.get(tenant, 0), self.config.tenant_limit(req.tenant_weight)
        if waiting >= limit:
            raise TenantShareExceededError(tenant, waiting, limit)

    def push(self, req: Request) -> None:
        assert req.request_id not in self._queued, req.request_id
        lane = self._lanes[req.lane]
        lane.set_weight(req.tenant, req.tenant_weight)
        # The scheduler checks new requests before it queues them; a requeued (preempted)
        # request is never refused and goes back to its arrival place.
        lane.push(req, requeue=True)
        self._queued[req.request_id] = req
        self._per_tenant[req.tenant] = self._per_tenant.get(req.tenant, 0) + 1

    def remove(self, req: Request) -> None:
        del self._queued[req.request_id]
        self._lanes[req.lane].remove(req)
        left = self._per_tenant[req.tenant] - 1
        if left:
            self._per_tenant[req.tenant] = left
        else:
            del self._per_tenant[req.tenant]

    def charge(self, req: Request, input_tokens: int = 0, output_tokens: int = 0) -> None:
        self._lanes[req.lane].charge(req.tenant, input_tokens, output_tokens)

    # -- order ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, req: object) -> bool:
        return isinstance(req, Request) and self._queued.get(req.request_id) is req

    def lane_sizes(self) -> dict[Lane, int]:
        return {lane: len(self._lanes[lane]) for lane in Lane}

    def effective_lane(self, req: Request, now: float) -> int:
        return max(0, int(req.lane) - int((now - req.enqueue_time) / self.aging_seconds))

    def counter(self, lane: Lane, tenant: str) -> float:
        """The tenant's virtual token counter in `lane` (weighted service so far)."""
        return self._lanes[lane].counter(tenant)

    def iter_lanes(self, first: int, last: int) -> Iterator[Request]:
        now = self.clock()
        # Each lane keeps its tenant-fair order; aging decides where its requests fall
        # among the other lanes'. A request that aged to level k lifts itself and every
        # request ahead of it in its lane's order to k, so the order within a lane never
        # changes and an old request is never left behind its own lane's newer ones.
        segments: list[list[Iterable[Request]]] = [[] for _ in self._lanes]
        for lane in range(last, first - 1, -1):
            fair = self._lanes[lane]
            if lane == first or all(self.effective_lane(r, now) >= lane for r in fair.unordered()):
                segments[lane].append(fair)  # walked lazily: nothing aged
                continue
            order = list(fair)
            level, cut = lane, len(order)
            for i in range(len(order) - 1, -1, -1):
                lifted = min(level, max(first, self.effective_lane(order[i], now)))
                if lifted < level:
                    segments[level].append(order[i + 1:cut])
                    level, cut = lifted, i + 1
            segments[level].append(order[:cut])
        # Per level: lifted requests waited longer than the level's own, so they come
        # first, the lowest lane first (segments were collected from the lowest lane up).
        for per_level in segments[first:last + 1]:
            for segment in per_level:
                for req in segment:
                    if req in self:
                        yield req


def waiting_queue(config: SchedulerConfig, clock: Callable[[], float]) -> RequestQueue:
    """The waiting queue `config.scheduling` names: FCFS lanes, or tenant-fair lanes."""
    if config.scheduling == "fcfs":
        return LaneQueue(config.aging_seconds, clock)
    # max_waiting 0 (refuse everything) is the scheduler's own check; the shares need >= 1.
    fairness = FairnessConfig(max_waiting=max(1, config.max_waiting), tenant_share=config.tenant_queue_share)
    return FairLaneQueue(config.aging_seconds, clock, fairness)
