"""The per-client failure throttle: a burst, a steady refill, bounded memory."""
from __future__ import annotations

import pytest

from loraplex.platform.tenancy.throttle import FailureThrottle, ThrottleConfig


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_burst_then_refill():
    clock = Clock()
    t = FailureThrottle(ThrottleConfig(burst=3, per_second=0.5), clock=clock)
    assert t.retry_after("a") == 0
    for _ in range(3):
        assert t.retry_after("a") == 0
        t.failed("a")
    assert t.retry_after("a") == pytest.approx(2.0)  # one attempt back after 1 / 0.5 s
    assert t.retry_after("b") == 0
    clock.now += 2.0
    assert t.retry_after("a") == 0
    t.failed("a")
    assert t.retry_after("a") > 0
    clock.now += 1000
    assert t.retry_after("a") == 0  # refills up to the burst, no more
    for _ in range(3):
        t.failed("a")
    assert t.retry_after("a") > 0


def test_table_of_clients_is_bounded():
    t = FailureThrottle(ThrottleConfig(burst=1, per_second=0.001, max_clients=100))
    for i in range(1000):
        t.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(t) == 100
    assert t.retry_after("10.0.3.231") > 0  # the most recent are remembered
    assert t.retry_after("10.0.0.0") == 0


def test_bad_config():
    with pytest.raises(ValueError):
        FailureThrottle(ThrottleConfig(burst=0))
