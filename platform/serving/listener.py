"""The HTTP listeners: uvicorn configured so slow or greedy clients cannot hold the server.

uvicorn bounds idle keep-alive connections and, with `limit_concurrency`, the number of
connections and requests, but nothing bounds how long a client may take to send its
request head or body: a few hundred connections sending a byte now and then (slowloris)
would hold every slot. `GuardedHttpProtocol` adds those bounds: a request head must
arrive within `header_timeout` seconds and stay under `max_header_bytes`, and a body may
not stall for more than `body_timeout` seconds; past either, the connection is closed.
The app sees a disconnect and has reserved nothing yet (bodies are read in full before
admission).

`/metrics` can have a listener of its own (`Settings.metrics_port`, loopback by
default), served by a second uvicorn server in the same event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from loraplex.platform.serving.metrics import CONTENT_TYPE
from loraplex.platform.settings import ServerLimits, Settings


class HeadTooLargeError(Exception):
    """Raised inside the parser's callbacks: httptools turns it into a 400 and a close."""


def guarded_protocol(limits: ServerLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the read bounds of `limits`."""

    class GuardedHttpProtocol(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None
        _head_bytes = 0

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            if self.flow is not None and self.flow.read_paused:  # the app is slow, not the client
                self._arm(limits.body_timeout)
                return
            self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm(limits.header_timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = 0
            self._arm(limits.header_timeout)

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value))
            super().on_header(name, value)

        def _count(self, n: int) -> None:
            self._head_bytes += n
            if self._head_bytes > limits.max_header_bytes:
                raise HeadTooLargeError(f"request head over {limits.max_header_bytes} bytes")

        def on_headers_complete(self) -> None:
            self._arm(limits.body_timeout)  # until the body (if any) is complete
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            self._arm(limits.body_timeout)
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

    return GuardedHttpProtocol


def uvicorn_config(app: Any, settings: Settings, **kw: Any) -> uvicorn.Config:
    """The main listener's configuration, bounded by `settings.limits`."""
    limits = settings.limits
    return uvicorn.Config(app, host=settings.host, port=settings.port, http=guarded_protocol(limits),
                          timeout_keep_alive=limits.keep_alive_timeout, limit_concurrency=limits.max_connections,
                          backlog=limits.backlog, proxy_headers=True,
                          forwarded_allow_ips=settings.forwarded_allow_ips, **kw)


def metrics_app(app: Starlette) -> Starlette:
    """A Starlette app with only `/metrics`: what the gateway `app` measured."""

    async def metrics(request: Request) -> Response:
        gw = getattr(app.state, "gateway", None)
        return Response(gw.metrics.render() if gw is not None else b"", media_type=CONTENT_TYPE)

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])


class _SideServer(uvicorn.Server):
    """A second server in the loop of the main one, which alone handles signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve(main: uvicorn.Server, app: Starlette, settings: Settings) -> None:
    """Run `main`, plus `/metrics` on its own listener when `settings.metrics_port` is set."""
    if settings.metrics_port is None:
        await main.serve()
        return
    side_config = uvicorn.Config(metrics_app(app), host=settings.metrics_host, port=settings.metrics_port,
                                 http=guarded_protocol(settings.limits), access_log=False, lifespan="off",
                                 limit_concurrency=64, log_config=None)  # the main server's logging stays
    side = _SideServer(side_config)
    task = asyncio.create_task(side.serve())
    try:
        await main.serve()
    finally:
        side.should_exit = True
        await task
