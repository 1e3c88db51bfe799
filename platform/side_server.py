"""A second uvicorn server in the event loop of the main one (`/metrics` on a port of its
own, for the gateway and the worker alike): the main server alone handles signals, and
the side server stops when the main one has."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

import uvicorn


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
