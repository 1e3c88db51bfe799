"""What the router knows: each worker's reported stats, and the request to place.

Workers report `WorkerStats` (polled, and carried on every response); the router adds
its own in-flight count and health verdict to make a `WorkerView`. Nothing here does I/O.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from loraplex.engine.client import EngineStats

from loraplex.platform.lanes import lane_name
from loraplex.platform.routing.errors import StatsError


class Residency(IntEnum):
    """Where a worker holds an adapter; a higher tier is cheaper to serve from."""

    ABSENT = 0
    CPU = 1
    DEVICE = 2


@dataclass(frozen=True)
class WorkerStats:
    """A worker's self-report. `waiting` maps lane name -> queued requests."""

    ready: bool = True
    draining: bool = False
    running: int = 0
    waiting: Mapping[str, int] = field(default_factory=dict)
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    device_adapters: frozenset[str] = frozenset()
    cpu_adapters: frozenset[str] = frozenset()
    max_loras: int = 0
    prefix_keys: tuple[str, ...] = ()  # recent `prefix_key()`s it served, newest last

    @property
    def waiting_total(self) -> int:
        return sum(self.waiting.values())

    def residency(self, adapter: str) -> Residency:
        if adapter in self.device_adapters:
            return Residency.DEVICE
        if adapter in self.cpu_adapters:
            return Residency.CPU
        return Residency.ABSENT

    def to_json(self) -> dict[str, Any]:
        return {"ready": self.ready, "draining": self.draining, "running": self.running,
                "waiting": dict(self.waiting), "kv_usage": self.kv_usage,
                "device_adapters": sorted(self.device_adapters),
                "cpu_adapters": sorted(self.cpu_adapters), "max_loras": self.max_loras,
                "prefix_keys": list(self.prefix_keys)}

    @classmethod
    def from_engine(cls, stats: EngineStats, *, ready: bool = True, draining: bool = False,
                    prefix_keys: Sequence[str] = ()) -> WorkerStats:
        """A worker's report from its engine's `EngineStats` (queues, KV usage, adapter tiers)."""
        return cls(ready=ready, draining=draining, running=stats.running,
                   waiting={lane_name(lane): depth.waiting for lane, depth in stats.lanes.items()},
                   kv_usage=min(1.0, max(0.0, float(stats.kv_cache_usage))),
                   device_adapters=frozenset(stats.adapters.device), cpu_adapters=frozenset(stats.adapters.cpu),
                   max_loras=stats.max_loras, prefix_keys=tuple(prefix_keys))

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> WorkerStats:
        """Parse a worker's stats document; unknown keys are ignored, bad values named."""
        if not isinstance(doc, Mapping):
            raise StatsError(f"worker stats must be an object, got {type(doc).__name__}")
        waiting = doc.get("waiting", {})
        if not isinstance(waiting, Mapping) or not all(
                isinstance(k, str) and _is_count(v) for k, v in waiting.items()):
            raise StatsError("worker stats 'waiting' must map lane names to counts >= 0")
        kv = doc.get("kv_usage", 0.0)
        if isinstance(kv, bool) or not isinstance(kv, (int, float)) or not 0.0 <= kv <= 1.0:
            raise StatsError(f"worker stats 'kv_usage' must be a number in [0, 1], got {kv!r}")
        return cls(ready=_flag(doc, "ready", True), draining=_flag(doc, "draining", False),
                   running=_count(doc, "running"), waiting=dict(waiting), kv_usage=float(kv),
                   device_adapters=frozenset(_strings(doc, "device_adapters")),
                   cpu_adapters=frozenset(_strings(doc, "cpu_adapters")),
                   max_loras=_count(doc, "max_loras"),
                   prefix_keys=tuple(_strings(doc, "prefix_keys")))


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _flag(doc: Mapping[str, Any], key: str, default: bool) -> bool:
    v = doc.get(key, default)
    if not isinstance(v, bool):
        raise StatsError(f"worker stats {key!r} must be true or false, got {v!r}")
    return v


def _count(doc: Mapping[str, Any], key: str) -> int:
    v = doc.get(key, 0)
    if not _is_count(v):
        raise StatsError(f"worker stats {key!r} must be an integer >= 0, got {v!r}")
    return v


def _strings(doc: Mapping[str, Any], key: str) -> list[str]:
    v = doc.get(key, [])
    if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) for s in v):
        raise StatsError(f"worker stats {key!r} must be a list of strings")
    return list(v)


@dataclass(frozen=True)
class WorkerView:
    """One worker as the router sees it: the last stats plus the router's own counts."""

    worker_id: str
    url: str
    healthy: bool
    in_flight: int  # requests this router sent there and not yet finished
    stats: WorkerStats

    @property
    def accepting(self) -> bool:
        """Whether the worker may get new requests (healthy, ready, not draining)."""
        return self.healthy and self.stats.ready and not self.stats.draining


@dataclass(frozen=True)
class RouteRequest:
    """What the router needs of a request: its adapter version's digest (None: the base
    model; workers report residency by digest too) and prefix key."""

    adapter: str | None = None
    prefix_key: str | None = None


def stable_hash(text: str) -> int:
    """A 64-bit hash equal in every process (Python's `hash` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def prefix_key(cache_salt: str, adapter_digest: str | None, token_ids: Sequence[int],
               block_size: int = 16, n_blocks: int = 4) -> str | None:
    """Key of a request's leading full blocks (up to `n_blocks`), or None if it has none.

    Same salt, adapter version and leading tokens give the same key, so a tenant's
    repeated prefix maps to the worker that cached it; workers report the keys they
    served. The adapter is its content digest, as the KV cache keys it: a name may be
    re-bound to other weights, whose cached KV is not this one's. Both sides must compute
    it alike (`GenerateRequest.prefix_key`); a gateway does not know a worker's KV block
    size, so the blocks here are a routing granularity, not the engine's.
    """
    n = min(len(token_ids) // block_size, n_blocks) * block_size
    if n == 0:
        return None
    h = hashlib.blake2b(digest_size=12)
    h.update(f"{cache_salt}\0{adapter_digest or ''}\0".encode())
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids[:n]))
    return h.hexdigest()
