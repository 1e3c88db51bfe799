"""Waiting requests, in the order admission considers them, behind one interface.

`LaneQueue` keeps one queue per lane, each in arrival order, and merges them lazily:
admission usually stops after a few candidates (token budget or batch width spent), so
a step pays for what it looks at, never a sort of everything waiting. The tenant-fair
order inside each lane is another `RequestQueue` (`fair_lanes.FairLaneQueue`).
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator

from ..request import Lane, Request


class RequestQueue(ABC):
    """Waiting requests in admission order.

    Contract: `push` adds a request (new, or requeued after a preemption); `remove`
    takes out any request in the queue (admitted, finished or aborted while waiting);
    iterating yields every queued request once, in the order admission should consider
    them at the moment iteration begins, and sees the queue as it was then, except that
    a request removed meanwhile is skipped (admission removes what it admits as it
    goes; requests pushed meanwhile wait for the next iteration); `peek` is the first
    of that order (None when empty) and `pop` removes and returns it; `len` counts the
    queued requests. `iter_lanes(first, last)` is the same order restricted to the
    requests that asked for a lane in [first, last], aging lifting none above `first`
    (the scheduler admits each class of lanes from its own budget). `check` raises (a
    typed engine error) when a new request may not join now; requeued requests are
    never checked. `charge` bills tokens computed for a
    request to whatever the order depends on. No tensors, no I/O.
    """

    def check(self, req: Request) -> None:
        pass

    def lane_sizes(self) -> dict[Lane, int]:
        """How many requests of each lane wait (by the lane they asked for)."""
        sizes = dict.fromkeys(Lane, 0)
        for req in self:
            sizes[req.lane] += 1
        return sizes

    def charge(self, req: Request, input_tokens: int = 0, output_tokens: int = 0) -> None:
        pass

    @abstractmethod
    def push(self, req: Request) -> None: ...

    @abstractmethod
    def remove(self, req: Request) -> None: ...

    @abstractmethod
    def iter_lanes(self, first: int, last: int) -> Iterator[Request]: ...

    def __iter__(self) -> Iterator[Request]:
        return self.iter_lanes(0, len(Lane) - 1)

    @abstractmethod
    def __len__(self) -> int: ...

    def __contains__(self, req: object) -> bool:
        return any(r is req for r in self)

    def peek(self) -> Request | None:
        return next(iter(self), None)

    def pop(self) -> Request:
        req = self.peek()
        if req is None:
            raise IndexError("pop from an empty request queue")
        self.remove(req)
        return req


class LaneQueue(RequestQueue):
    """Order: effective lane (a request climbs one lane per `aging_seconds` since it was
    queued, so batch never starves), then arrival, then queueing order."""

    def __init__(self, aging_seconds: float, clock: Callable[[], float]) -> None:
        self.aging_seconds = aging_seconds
        self.clock = clock
        # Per lane: (arrival time, push number, request), sorted. Pushes arrive in arrival
        # order except requeued (preempted) requests, which bisect back to their place.
        self._lanes: list[list[tuple[float, int, Request]]] = [[] for _ in Lane]
        self._key: dict[str, tuple[float, int, Request]] = {}
        self._seq = itertools.count()

    def push(self, req: Request) -> None:
        assert req.request_id not in self._key, req.request_id
        key = self._key[req.request_id] = (req.arrival_time, next(self._seq), req)
        lane = self._lanes[req.lane]
        if not lane or _order(lane[-1]) < _order(key):
            lane.append(key)
        else:
            bisect.insort(lane, key, key=_order)

    def remove(self, req: Request) -> None:
        key = self._key.pop(req.request_id)
        lane = self._lanes[req.lane]
        i = bisect.bisect_left(lane, _order(key), key=_order)
        assert lane[i][2] is req
        del lane[i]

    def __len__(self) -> int:
        return len(self._key)

    def __contains__(self, req: object) -> bool:
        return isinstance(req, Request) and self._key.get(req.request_id, (0, 0, None))[2] is req

    def lane_sizes(self) -> dict[Lane, int]:
        return {lane: len(self._lanes[lane]) for lane in Lane}

    def effective_lane(self, req: Request, now: float) -> int:
        return max(0, int(req.lane) - int((now - req.enqueue_time) / self.aging_seconds))

    def iter_lanes(self, first: int, last: int) -> Iterator[Request]:
        now = self.clock()
        # One pass sorts nothing: each lane's entries, already in arrival order, go to
        # their effective level; each level then merges its lanes' runs.
        levels: list[list[list[tuple[float, int, Request]]]] = [[[] for _ in self._lanes] for _ in self._lanes]
        for lane in range(first, last + 1):
            entries = self._lanes[lane]
            if lane == first:
                levels[first][first] = list(entries)
                continue
            for entry in entries:
                levels[max(first, self.effective_lane(entry[2], now))][lane].append(entry)
        for runs in levels[first:last + 1]:
            for entry in heapq.merge(*(r for r in runs if r), key=_order):
                if self._key.get(entry[2].request_id) is entry:
                    yield entry[2]


def _order(entry: tuple[float, int, Request]) -> tuple[float, int]:
    return entry[0], entry[1]


class AdmissionPolicy(ABC):
    """Which waiting requests admission considers in a step, and in which order.

    Contract: `candidates(waiting, running, first, last)` returns requests of `waiting`
    that asked for a lane in [first, last] (each at most once) for admission to try in
    order; `running` is how many requests run now. The
    scheduler then calls `admitted` for each request it starts, `requeued` for each
    running request it preempts back into `waiting`, and `dropped` for each request
    that leaves `waiting` otherwise (finished or aborted), so a policy's own state
    follows the queue.
    """

    @abstractmethod
    def candidates(self, waiting: RequestQueue, running: int, first: int = 0,
                   last: int = len(Lane) - 1) -> Iterable[Request]: ...

    def admitted(self, req: Request) -> None:
        pass

    def requeued(self, req: Request) -> None:
        pass

    def dropped(self, req: Request) -> None:
        pass


class ContinuousPolicy(AdmissionPolicy):
    """Iteration-level: every step considers every waiting request in queue order."""

    def __init__(self, max_num_seqs: int) -> None:
        pass

    def candidates(self, waiting: RequestQueue, running: int, first: int = 0,
                   last: int = len(Lane) - 1) -> Iterable[Request]:
        return waiting.iter_lanes(first, last)


class StaticBatchPolicy(AdmissionPolicy):
    """The baseline the benchmarks compare against: a batch of the first `max_num_seqs`
    waiting requests is admitted only once the previous batch has fully finished
    (its preempted requests rejoin it)."""

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.batch: list[Request] = []

    def candidates(self, waiting: RequestQueue, running: int, first: int = 0,
                   last: int = len(Lane) - 1) -> Iterable[Request]:
        if not running and not self.batch:
            self.batch = list(itertools.islice(waiting, self.max_num_seqs))
        return [r for r in self.batch if first <= r.lane <= last]

    def admitted(self, req: Request) -> None:
        if req in self.batch:
            self.batch.remove(req)

    dropped = admitted

    def requeued(self, req: Request) -> None:
        self.batch.append(req)


POLICIES: dict[str, type[AdmissionPolicy]] = {"continuous": ContinuousPolicy, "static": StaticBatchPolicy}
