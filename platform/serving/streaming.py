"""Client-disconnect handling and the SSE response.

Starlette's StreamingResponse notices a disconnect only when a write fails (ASGI 2.4
servers), which for a queued request or a slow model can be long after the client left.
Here every wait on the engine races the connection's `http.disconnect`, so a client that
goes away aborts its engine request at once (the engine iterator's `finally` aborts it).

A client that stays connected but stops reading makes the server's writes wait (flow
control): a write that waits longer than `STREAM_WRITE_TIMEOUT` ends the response as if
the client had left, so the request is aborted and billed for what was sent, and the
engine's queue for it (bounded too: async_engine.MAX_STREAM_BACKLOG) stops growing.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.types import Receive, Scope, Send

T = TypeVar("T")
STREAM_WRITE_TIMEOUT = 30.0  # seconds one write to a client that stopped reading may wait


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel(task: asyncio.Future) -> None:
    if not task.done():
        task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - its outcome no longer matters
        pass


async def until_disconnected(receive: Receive, aw: Awaitable[T]) -> T:
    """Await `aw`, cancelling it (and raising ClientDisconnected) if the client leaves first."""
    work = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await _cancel(work)
        raise
    finally:
        if not watch.done():
            watch.cancel()
    if work.done():
        return work.result()
    await _cancel(work)
    raise ClientDisconnected()


SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream
]


class SSEResponse:
    """Streams already-framed SSE bytes; a disconnect cancels the stream and closes it.

    `source` is the stream `chunks` is made from: it is closed too, whatever happened, even
    if `chunks` never started (closing a never-started generator skips its `finally`), so
    the request it belongs to always finishes.
    """

    status_code = 200

    def __init__(self, chunks: AsyncIterator[bytes], extra_headers: list[tuple[bytes, bytes]] = (),
                 source: AsyncIterator | None = None, write_timeout: float = STREAM_WRITE_TIMEOUT) -> None:
        self.chunks = chunks
        self.source = source
        self.write_timeout = write_timeout
        self.headers = SSE_HEADERS + list(extra_headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = watch = None
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            pump = asyncio.ensure_future(self._pump(send))
            watch = asyncio.ensure_future(_wait_disconnect(receive))
            await asyncio.wait((pump, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if watch is not None:
                await _cancel(watch)
            if pump is not None:
                await _cancel(pump)
            await self.chunks.aclose()
            if self.source is not None:
                await self.source.aclose()
        if pump.done() and not pump.cancelled() and pump.exception() is None:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, send: Send) -> None:
        async for chunk in self.chunks:
            try:
                await asyncio.wait_for(send({"type": "http.response.body", "body": chunk, "more_body": True}),
                                       self.write_timeout)
            except asyncio.TimeoutError:
                raise ClientDisconnected("the client stopped reading the stream") from None
