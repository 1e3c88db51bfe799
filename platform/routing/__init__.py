"""Routing requests over engine workers: adapter affinity with bounded load, health, drain.

The decision code (table, policies, pool) is pure and synchronous; `HealthPoller` is the
only part that awaits, and its transport (the stats probe) is injected.
"""
from __future__ import annotations

from loraplex.platform.routing.config import RouterConfig
from loraplex.platform.routing.discovery import (
    Discovery,
    DnsDiscovery,
    StaticDiscovery,
    discovery_for,
    normalize_url,
)
from loraplex.platform.routing.errors import DiscoveryError, NoCapacityError, StatsError
from loraplex.platform.routing.table import Fleet
from loraplex.platform.routing.poller import HealthPoller
from loraplex.platform.routing.policy import AffinityPolicy, RoundRobinPolicy, RoutingPolicy, make_policy
from loraplex.platform.routing.pool import Lease, WorkerPool
from loraplex.platform.routing.view import (
    Residency,
    RouteRequest,
    WorkerStats,
    WorkerView,
    prefix_key,
    stable_hash,
)

__all__ = [
    "AffinityPolicy", "Discovery", "DiscoveryError", "DnsDiscovery", "Fleet", "HealthPoller", "Lease",
    "NoCapacityError", "Residency", "RouteRequest", "RoundRobinPolicy", "RouterConfig", "RoutingPolicy",
    "StaticDiscovery", "StatsError", "WorkerPool", "WorkerStats", "WorkerView", "discovery_for", "make_policy",
    "normalize_url", "prefix_key", "stable_hash",
]
