"""The SSE response: a disconnect (platform/http.py's watcher) cancels the stream and closes it.

A write that waits longer than `STREAM_WRITE_TIMEOUT` (a client that stopped reading) ends
the response as if the client had left, so the request is aborted and billed for what was
sent, and the engine's queue for it (bounded too: async_engine.MAX_STREAM_BACKLOG) stops
growing.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.types import Receive, Scope, Send

from loraplex.platform.http import STREAM_WRITE_TIMEOUT, cancel_and_wait, send_within, wait_disconnect


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
            watch = asyncio.ensure_future(wait_disconnect(receive))
            await asyncio.wait((pump, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if watch is not None:
                await cancel_and_wait(watch)
            if pump is not None:
                await cancel_and_wait(pump)
            await self.chunks.aclose()
            if self.source is not None:
                await self.source.aclose()
        if pump.done() and not pump.cancelled() and pump.exception() is None:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, send: Send) -> None:
        async for chunk in self.chunks:
            await send_within(send, {"type": "http.response.body", "body": chunk, "more_body": True},
                              self.write_timeout)
