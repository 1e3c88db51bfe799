from __future__ import annotations

from loraplex.platform.routing import RouterConfig, WorkerPool


def urls(n: int) -> list[str]:
    return [f"http://10.0.0.{i + 1}:8000" for i in range(n)]


def pool_of(n: int, **config) -> WorkerPool:
    """A pool over `n` workers that have reported nothing yet (all accepting, empty)."""
    pool = WorkerPool(RouterConfig(**config))
    pool.set_members(urls(n))
    return pool
