"""Health leave/rejoin, draining, capacity refusal, retry exclusion, lease bookkeeping."""
from __future__ import annotations

import pytest

from loraplex.platform.errors import api_error
from loraplex.platform.routing import NoCapacityError, RouteRequest, WorkerStats
from tests.platform.routing.conftest import pool_of, urls

REQ = RouteRequest(adapter="a")


def placements(pool, n: int = 40) -> set[str]:
    """Where `n` base-model requests land (released right away: the least loaded, in turn)."""
    got = set()
    for _ in range(n):
        lease = pool.acquire(RouteRequest())
        pool.release(lease)
        got.add(lease.worker_id)
    return got


def test_a_worker_failing_health_checks_leaves_and_rejoins_when_healthy():
    pool = pool_of(3, failure_threshold=2)
    sick = urls(3)[0]
    pool.record_health(sick, None)
    assert sick in placements(pool)  # one failure is not enough
    pool.record_health(sick, None)
    assert sick not in placements(pool)
    assert not pool.fleet.view(sick).healthy
    pool.record_health(sick, WorkerStats())
    assert sick in placements(pool)


def test_a_failed_request_takes_the_worker_out_at_once():
    pool = pool_of(2)
    lease = pool.acquire(REQ)
    pool.fail(lease)
    assert placements(pool) == set(urls(2)) - {lease.worker_id}
    assert pool.fleet.total_in_flight == 0


@pytest.mark.parametrize("stats", [WorkerStats(draining=True), WorkerStats(ready=False)])
def test_draining_or_unready_workers_get_nothing_new_but_finish_what_they_run(stats):
    pool = pool_of(3)
    lease = pool.acquire(REQ)
    pool.update_stats(lease.worker_id, stats)
    assert lease.worker_id not in placements(pool, 60)
    pool.release(lease, stats)  # stats carried on its last response
    assert pool.fleet.in_flight(lease.worker_id) == 0
    assert lease.worker_id not in placements(pool, 60)


def test_beyond_the_in_flight_limit_the_router_refuses_with_503_and_retry_after():
    pool = pool_of(2, max_in_flight=3, retry_after_s=2.0)
    held = [pool.acquire(RouteRequest(adapter=f"a{i % 2}")) for i in range(6)]
    assert sorted(v.in_flight for v in pool.workers()) == [3, 3]
    with pytest.raises(NoCapacityError, match="in-flight limit") as exc:
        pool.acquire(REQ)
    assert exc.value.retry_after == 2.0
    err = api_error(exc.value)
    assert err.status == 503 and "Retry-After" in err.headers
    pool.release(held[0])
    pool.acquire(REQ)  # room again


def test_no_workers_is_no_capacity():
    pool = pool_of(1)
    pool.record_health(urls(1)[0], None)
    pool.record_health(urls(1)[0], None)
    with pytest.raises(NoCapacityError, match="no inference worker"):
        pool.acquire(REQ)
    pool.set_members([])
    with pytest.raises(NoCapacityError):
        pool.acquire(REQ)


def test_retry_goes_once_to_another_worker():
    pool = pool_of(3)
    first = pool.acquire(REQ)
    second = pool.retry(first)
    assert second.worker_id != first.worker_id and second.request == REQ
    assert pool.in_flight == 1 and pool.fleet.in_flight(first.worker_id) == 0
    assert not pool.fleet.view(first.worker_id).healthy


def test_retry_excludes_the_failed_worker_even_when_it_would_be_the_only_choice():
    pool = pool_of(1)
    with pytest.raises(NoCapacityError):
        pool.retry(pool.acquire(REQ))


def test_exclusion_wins_over_the_load_bound():
    pool = pool_of(2)
    a, b = urls(2)
    held = [pool.acquire(REQ) for _ in range(4)]
    assert {lease.worker_id for lease in held} == {a, b}
    while pool.fleet.in_flight(b) <= pool.fleet.in_flight(a):  # b over its bound share
        held.append(pool.acquire(RouteRequest(adapter="x"), exclude=frozenset({a})))
    assert pool.acquire(REQ, exclude=frozenset({a})).worker_id == b


def test_release_is_idempotent_and_departed_workers_drop_their_leases():
    pool = pool_of(3)
    lease = pool.acquire(REQ)
    pool.release(lease)
    pool.release(lease)
    assert pool.fleet.total_in_flight == 0 and pool.in_flight == 0
    held = [pool.acquire(RouteRequest(adapter=f"a{i}")) for i in range(9)]
    gone = held[0].worker_id
    added, removed = pool.set_members([u for u in urls(3) if u != gone] + ["http://10.0.0.9:8000"])
    assert added == ["http://10.0.0.9:8000"] and removed == [gone]
    for lease in held:
        pool.release(lease)
    assert pool.fleet.total_in_flight == 0 and pool.in_flight == 0
    assert gone not in placements(pool)


def test_a_late_report_from_a_departed_worker_is_ignored():
    pool = pool_of(2)
    pool.set_members(urls(1))
    pool.update_stats(urls(2)[1], WorkerStats(device_adapters=frozenset({"a"})))
    pool.record_health(urls(2)[1], WorkerStats())
    assert [v.worker_id for v in pool.workers()] == urls(1)
