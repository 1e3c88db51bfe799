"""The router's one config dataclass."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    """Knobs of adapter-affinity routing, capacity and worker health.

    `epsilon`: bounded-load slack; no worker is sent a request that would take its
    in-flight count past ceil((1 + epsilon) * mean).  `probe`: how many admissible
    workers along the adapter's ring walk compete with the ones already holding it.
    """

    policy: str = "affinity"  # "affinity" | "round_robin"
    epsilon: float = 0.2
    vnodes: int = 100  # ring points per worker
    probe: int = 2
    max_in_flight: int = 256  # per worker, per gateway; beyond it: NoCapacityError
    prefix_entries: int = 65536  # prefix keys remembered (LRU)
    failure_threshold: int = 2  # failed health checks in a row before a worker leaves
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    dns_interval_s: float = 10.0
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if self.policy not in ("affinity", "round_robin"):
            raise ValueError(f"router policy must be 'affinity' or 'round_robin', got {self.policy!r}")
        if self.epsilon <= 0:
            raise ValueError(f"router epsilon must be > 0, got {self.epsilon}")
        for name in ("vnodes", "probe", "max_in_flight", "prefix_entries", "failure_threshold"):
            if getattr(self, name) < 1:
                raise ValueError(f"router {name} must be >= 1, got {getattr(self, name)}")
