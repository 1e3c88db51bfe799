"""The HTTP listeners: uvicorn configured so slow or greedy clients cannot hold the server.

uvicorn bounds idle keep-alive connections and, with `limit_concurrency`, the number of
connections and requests, but nothing bounds how long a client may take to send its
request head or body: a few hundred connections sending a byte now and then (slowloris)
would hold every slot. `GuardedHttpProtocol` adds, per connection:

- a deadline for the request head (`header_timeout`, total, and `max_header_bytes`);
- a deadline for the body, as Apache's mod_reqtimeout sets one: `body_timeout` seconds,
  extended by one second per `body_min_rate` bytes received, so a body trickled in a
  byte at a time is cut off after `body_timeout` whatever it sends, while a large body
  sent at a sane rate has the time it needs. Past either deadline the connection is
  closed; the app sees a disconnect and has reserved nothing yet (bodies are read in full
  before admission). Time the app leaves the body unread does not count;
- when the app answers before the body is in (a 401 or 413 before reading it), the
  response says `Connection: close` and the rest of the body is not read: the server
  half-closes and discards what is still in flight for at most `LINGER_SECONDS` /
  `LINGER_BYTES` (so the client reads the answer instead of a reset), then closes;
- at most `max_connections_per_client` connections from one address: past it a
  connection gets a 429 and is closed before anything it sends is parsed. Proxies
  trusted with `--forwarded-allow-ips` carry many clients and are not capped here;
- small send buffers (`send_buffer_bytes`, and `stream_send_buffer_bytes` while a
  response streams), so output for a client that stops reading backs up into the app
  within a few KiB, where the engine pauses its request;
- `/health` and `/ready` are answered past `max_connections` (uvicorn's 503 when
  saturated), so the probes of an orchestrator never fail because tenants filled it.

`/metrics` can have a listener of its own (`Settings.metrics_port`, loopback by
default), served by a second uvicorn server in the same event loop
(`platform/side_server.py`).
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections import Counter
from collections.abc import Coroutine
from typing import Any, ClassVar, TypeVar

import orjson

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from loraplex.platform.errors import RateLimitedError, api_error
from loraplex.engine.threads import use_serial_default_executor
from loraplex.platform.heap import freeze_startup_heap
from loraplex.platform.metrics import CONTENT_TYPE
from loraplex.platform.settings import ServerLimits, Settings
from loraplex.platform.side_server import serve_beside, side_config

T = TypeVar("T")
# After an early answer, how long and how much of the unread body is still taken in.
LINGER_SECONDS = 2.0
LINGER_BYTES = 256 * 1024
PROBE_PATHS = frozenset({b"/health", b"/ready"})


STREAM_TYPES = (b"text/event-stream", b"application/x-ndjson")


def _is_stream(start: Any) -> bool:
    """The response streams tokens: SSE, or the worker's NDJSON to a gateway."""
    return any(k.lower() == b"content-type" and v.startswith(STREAM_TYPES) for k, v in start.get("headers", ()))


class HeadTooLargeError(Exception):
    """Raised inside the parser's callbacks: httptools turns it into a 400 and a close."""


class TrustedPeers:
    """Addresses matching uvicorn's `forwarded_allow_ips` (addresses, CIDR ranges, '*')."""

    def __init__(self, spec: str) -> None:
        items = [x.strip() for x in spec.split(",") if x.strip()]
        self.everyone = "*" in items
        self.networks, self.names = [], set()
        for item in items:
            try:
                self.networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                self.names.add(item)

    def __contains__(self, host: str) -> bool:
        if self.everyone or host in self.names:
            return True
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(addr in net for net in self.networks)


def over_cap_response(limit: int) -> bytes:
    err = api_error(RateLimitedError(f"more than {limit} connections from this address", 1.0))
    body = orjson.dumps(err.body())
    return (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))


class ConnectionGuard:
    """What every connection of one server shares: its limits, the connections each client
    address holds, the trusted proxies (not held to the per-address cap)."""

    def __init__(self, limits: ServerLimits, trusted: str = "") -> None:
        self.limits = limits
        self.per_client: Counter[str] = Counter()
        self.proxies = TrustedPeers(trusted)
        self.over_cap = over_cap_response(limits.max_connections_per_client)


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol under a `ConnectionGuard`: header and body deadlines,
    the head's size, the per-address connection cap, an early answer closing the
    connection instead of reading the rest of the body. `guarded_protocol` binds a guard."""

    guard: ClassVar[ConnectionGuard]
    _timer: asyncio.TimerHandle | None = None
    _head_bytes = 0
    _counted: str | None = None  # the address this connection counts against
    _refused = False  # over the per-address cap: answered 429, never parsed
    _body_pending = False  # the head is in, the body is not complete yet
    _body_deadline = 0.0
    _close_after_response = False  # answered before the body was in
    _lingering = False
    _lingered = 0
    _streaming = False  # the response streams: its buffers are the small ones

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(max(0.0, seconds), self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._lingering:
            self.transport.close()
            return
        now = self.loop.time()
        if self.flow is not None and self.flow.read_paused:  # the app is slow, not the client
            self._body_deadline = max(self._body_deadline, now + self.guard.limits.body_timeout)
            self._arm(self.guard.limits.body_timeout)
            return
        if self._body_pending and self._body_deadline > now:  # the body's rate earned more time
            self._arm(self._body_deadline - now)
            return
        self.transport.close()

    # -- connections: the per-address cap --------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        host = peer[0] if isinstance(peer, tuple) and peer else None
        if host is not None and host not in self.guard.proxies:
            if self.guard.per_client[host] >= self.guard.limits.max_connections_per_client:
                self._refuse(transport)
                return
            self.guard.per_client[host] += 1
            self._counted = host
        # Output for a client that stops reading backs up into the engine (which pauses
        # its request) after this much in the kernel and as much again in the transport.
        self._send_buffers(transport, self.guard.limits.send_buffer_bytes)
        super().connection_made(transport)
        self._arm(self.guard.limits.header_timeout)

    @staticmethod
    def _send_buffers(transport: asyncio.Transport, size: int) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # the peer may be gone already
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        transport.set_write_buffer_limits(high=size)

    def _refuse(self, transport: asyncio.Transport) -> None:
        self.transport, self._refused = transport, True
        transport.write(self.guard.over_cap)
        self._start_linger()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._counted is not None:
            self.guard.per_client[self._counted] -= 1
            if self.guard.per_client[self._counted] <= 0:
                del self.guard.per_client[self._counted]
            self._counted = None
        if not self._refused:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # taken in and dropped, so the client reads our answer
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES:
                self.transport.close()
            return
        super().data_received(data)

    def eof_received(self) -> bool | None:
        if self._lingering:
            self.transport.close()
            return None
        return super().eof_received()

    def _start_linger(self) -> None:
        self._lingering = True
        if self.flow is not None:
            self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._arm(LINGER_SECONDS)

    # -- the request head --------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._arm(self.guard.limits.header_timeout)

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        super().on_header(name, value)

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.guard.limits.max_header_bytes:
            raise HeadTooLargeError(f"request head over {self.guard.limits.max_header_bytes} bytes")

    def on_headers_complete(self) -> None:
        self._body_pending = True
        self._body_deadline = self.loop.time() + self.guard.limits.body_timeout
        self._arm(self.guard.limits.body_timeout)
        probe = self.url.split(b"?", 1)[0] in PROBE_PATHS and self.parser.get_method() == b"GET"
        saved = self.limit_concurrency
        if probe:  # never refused for a full server: the probes must see it alive
            self.limit_concurrency = None
        try:
            super().on_headers_complete()
        finally:
            self.limit_concurrency = saved
        if self.cycle is not None:
            self._watch_early_answer(self.cycle)

    # -- the body ------------------------------------------------------------------------
    def on_body(self, body: bytes) -> None:
        self._body_deadline += len(body) / self.guard.limits.body_min_rate
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._body_pending = False
        self._disarm()
        super().on_message_complete()

    def _watch_early_answer(self, cycle: Any) -> None:
        """A response that starts before the body is in says Connection: close, and the
        connection lingers briefly instead of reading the rest."""
        send = cycle.send

        async def send_or_close(message: Any) -> None:
            if message["type"] == "http.response.start" and _is_stream(message):
                self._streaming = True
                self._send_buffers(self.transport, self.guard.limits.stream_send_buffer_bytes)
            if message["type"] != "http.response.start" or not (self._body_pending and self.cycle is cycle):
                await send(message)
                return
            self._close_after_response = True
            cycle.keep_alive = False  # the head says close
            await send(message)
            cycle.keep_alive = True  # uvicorn must not close at once: on_response_complete lingers

        cycle.send = send_or_close

    def on_response_complete(self) -> None:
        if self._streaming and not self.transport.is_closing():
            self._streaming = False
            self._send_buffers(self.transport, self.guard.limits.send_buffer_bytes)
        if self._close_after_response:
            self.server_state.total_requests += 1
            if not self.transport.is_closing():
                self._start_linger()
            return
        super().on_response_complete()


def guarded_protocol(limits: ServerLimits, trusted: str = "") -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the read bounds of `limits`; peers in `trusted`
    (proxies) are not held to the per-address connection cap."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"guard": ConnectionGuard(limits, trusted)})


def uvicorn_config(app: Any, settings: Settings, **kw: Any) -> uvicorn.Config:
    """The main listener's configuration, bounded by `settings.limits`."""
    limits = settings.limits
    return uvicorn.Config(app, host=settings.host, port=settings.port,
                          http=guarded_protocol(limits, settings.forwarded_allow_ips),
                          timeout_keep_alive=limits.keep_alive_timeout, limit_concurrency=limits.max_connections,
                          backlog=limits.backlog, proxy_headers=True,
                          forwarded_allow_ips=settings.forwarded_allow_ips, **kw)


def metrics_app(app: Starlette) -> Starlette:
    """A Starlette app with only `/metrics`: what the gateway `app` measured."""

    async def metrics(request: Request) -> Response:
        gw = getattr(app.state, "gateway", None)
        return Response(gw.metrics.render() if gw is not None else b"", media_type=CONTENT_TYPE)

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` (a `serve`) to completion on uvloop where it is installed, as
    `uvicorn.Server.run` does for the worker role, else on asyncio's own loop, whose
    transports write each streamed chunk in Python: serving vLLM's benchmark (64 streams
    at once, 2 cores) the server's threads beside the engine's took 0.88 s of CPU over a
    14 s run on asyncio's loop and 0.6 s on uvloop, time the engine's OpenMP threads lose
    where no core is idle."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


async def serve(main: uvicorn.Server, app: Starlette, settings: Settings) -> None:
    """Run `main`, plus `/metrics` on its own listener when `settings.metrics_port` is set."""
    freeze_startup_heap()
    use_serial_default_executor()
    side = None
    if settings.metrics_port is not None:
        side = side_config(metrics_app(app), settings.metrics_host, settings.metrics_port,
                           http=guarded_protocol(settings.limits, settings.forwarded_allow_ips))
    await serve_beside(main.serve(), side)
