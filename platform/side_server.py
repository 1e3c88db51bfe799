"""A second uvicorn server in the event loop of the main one (`/metrics` on a port of its
own, for the gateway and the worker alike): the main server alone handles signals, and
the side server stops when the main one has."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any

import uvicorn


def side_config(app: Any, host: str, port: int, **kw: Any) -> uvicorn.Config:
    """A side listener's configuration: only scrapers call it, so a few connections, no
    lifespan (the main app runs that), the main server's logging; `kw` adds to it (the
    gateway's guarded protocol)."""
    return uvicorn.Config(app, host=host, port=port, access_log=False, lifespan="off", limit_concurrency=64,
                          log_config=None, **kw)


class _SideServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve_beside(main: Awaitable[None], side: uvicorn.Config | None) -> None:
    """Await `main` (a server's `serve()`), with `side` served in the same loop until it ends."""
    if side is None:
        await main
        return
    server = _SideServer(side)
    task = asyncio.create_task(server.serve())
    try:
        await main
    finally:
        server.should_exit = True
        await task
