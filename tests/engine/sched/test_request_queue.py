"""The lane queue yields what a full sort by (effective lane, arrival) would, and the
admission policies keep their state in step with it."""
from __future__ import annotations

import random

import pytest

from loraplex.engine.request import Lane, Request, SamplingParams
from loraplex.engine.sched.request_queue import ContinuousPolicy, LaneQueue, StaticBatchPolicy

AGING = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _req(rid: str, lane: Lane, arrival: float, enqueue: float) -> Request:
    return Request(rid, [1, 2], SamplingParams(max_tokens=1), lane, arrival_time=arrival, enqueue_time=enqueue)


def _sorted(reqs: list[Request], queue: LaneQueue, now: float) -> list[str]:
    """The reference order: a stable sort of everything waiting by (effective lane, arrival)."""
    return [r.request_id for r in sorted(reqs, key=lambda r: (queue.effective_lane(r, now), r.arrival_time))]


@pytest.mark.parametrize("seed", range(20))
def test_order_is_effective_lane_then_arrival(seed):
    rng = random.Random(seed)
    clock = Clock()
    queue = LaneQueue(AGING, clock)
    pushed: list[Request] = []
    for i in range(rng.randrange(1, 60)):
        clock.now += rng.choice([0.0, 0.5, 3.0])
        # Requeued requests keep an old arrival time but are queued now.
        arrival = clock.now if rng.random() < 0.8 else rng.uniform(0, clock.now)
        req = _req(f"r{i}", rng.choice(list(Lane)), arrival, clock.now)
        queue.push(req)
        pushed.append(req)
        if rng.random() < 0.2:
            gone = pushed.pop(rng.randrange(len(pushed)))
            queue.remove(gone)
            assert gone not in queue
    clock.now += rng.choice([0.0, 4.0, 7.0, 12.0])
    assert [r.request_id for r in queue] == _sorted(pushed, queue, clock.now)
    assert len(queue) == len(pushed) and all(r in queue for r in pushed)


def test_iteration_skips_removed_and_ignores_pushed_requests():
    clock = Clock()
    queue = LaneQueue(AGING, clock)
    a, b, c = (_req(n, Lane.STANDARD, t, t) for n, t in (("a", 1.0), ("b", 2.0), ("c", 3.0)))
    for r in (a, b, c):
        queue.push(r)
    seen = []
    for r in queue:
        seen.append(r.request_id)
        if r is a:
            queue.remove(a)  # admitted
            queue.remove(b)  # aborted meanwhile
            queue.push(_req("late", Lane.INTERACTIVE, 0.5, 4.0))  # a preempted request
    assert seen == ["a", "c"]
    assert [r.request_id for r in queue] == ["late", "c"]
    assert queue.pop().request_id == "late" and queue.peek() is c


def test_aging_lifts_batch_over_newer_standard():
    clock = Clock()
    queue = LaneQueue(AGING, clock)
    old_batch = _req("batch", Lane.BATCH, 0.0, 0.0)
    queue.push(old_batch)
    clock.now = 6.0
    queue.push(_req("std", Lane.STANDARD, 6.0, 6.0))
    assert [r.request_id for r in queue] == ["batch", "std"]  # both at effective lane 1, batch arrived first
    clock.now = 10.0
    queue.push(_req("inter", Lane.INTERACTIVE, 10.0, 10.0))
    assert [r.request_id for r in queue] == ["batch", "inter", "std"]  # batch aged twice, std not yet
    clock.now = 11.0
    assert [r.request_id for r in queue] == ["batch", "std", "inter"]  # all at lane 0: arrival order


def test_static_policy_admits_one_batch_at_a_time():
    clock = Clock()
    queue = LaneQueue(AGING, clock)
    reqs = [_req(f"r{i}", Lane.STANDARD, float(i), float(i)) for i in range(5)]
    for r in reqs:
        queue.push(r)
    policy = StaticBatchPolicy(max_num_seqs=2)
    assert policy.candidates(queue, running=0) == reqs[:2]
    policy.admitted(reqs[0])
    queue.remove(reqs[0])
    assert policy.candidates(queue, running=1) == reqs[1:2]  # the rest wait for the batch to finish
    policy.requeued(reqs[0])
    assert policy.candidates(queue, running=1) == [reqs[1], reqs[0]]
    policy.dropped(reqs[1])
    policy.admitted(reqs[0])
    assert policy.candidates(queue, running=0) == [reqs[1], reqs[2]]  # the next batch, from the queue
    assert list(ContinuousPolicy(2).candidates(queue, running=5)) == list(queue)
